"""`python -m sandwich_tvm.topo`: see sandwich_tvm.cli.topo."""

import sys

from .cli.topo import main

if __name__ == "__main__":
    sys.exit(main())
