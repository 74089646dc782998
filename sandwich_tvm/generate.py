"""`python -m sandwich_tvm.generate`: see sandwich_tvm.cli.generate."""

import sys

from .cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
