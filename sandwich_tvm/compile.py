"""`python -m sandwich_tvm.compile`: see sandwich_tvm.cli.compile."""

import sys

from .cli.compile import main

if __name__ == "__main__":
    sys.exit(main())
