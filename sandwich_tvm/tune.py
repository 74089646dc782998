"""`python -m sandwich_tvm.tune`: see sandwich_tvm.cli.tune."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("cli.tune"))
