"""``python -m pagedspec.serve --model M ...``: the same as ``pagedspec serve``."""
import sys

from pagedspec.serve.app import main

sys.exit(main())
