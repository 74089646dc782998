"""`python -m sandwich_tvm.compile`: see sandwich_tvm.cli.compile."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("cli.compile"))
