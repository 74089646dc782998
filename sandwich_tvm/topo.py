"""`python -m sandwich_tvm.topo`: see sandwich_tvm.cli.topo."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("cli.topo"))
