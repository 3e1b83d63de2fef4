"""``python -m pagedspec``: the command line (``pagedspec generate``, ``pagedspec bench``)."""
import sys

from pagedspec.cli import main

if __name__ == "__main__":
    sys.exit(main())
