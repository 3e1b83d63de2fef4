"""``python -m pagedspec.bench``: run the kernel benchmarks, then the end-to-end section (see
pagedspec.bench.runner)."""
import sys

from pagedspec.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
