"""`python -m sandwich_tvm.generate`: see sandwich_tvm.cli.generate."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("cli.generate"))
