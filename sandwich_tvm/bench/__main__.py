"""`python -m sandwich_tvm.bench`: see sandwich_tvm.bench.cli."""

import sys

from ..cli.entry import run

if __name__ == "__main__":
    sys.exit(run("bench.cli"))
