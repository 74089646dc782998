"""`python -m sandwich_tvm.tune`: see sandwich_tvm.cli.tune."""

import sys

from .cli.tune import main

if __name__ == "__main__":
    sys.exit(main())
