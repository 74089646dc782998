"""`python -m sandwich_tvm.bench`: see sandwich_tvm.cli.bench."""

import sys

from .cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
