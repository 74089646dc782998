"""`python -m sandwich_tvm.serve`: see sandwich_tvm.cli.serve."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("cli.serve"))
