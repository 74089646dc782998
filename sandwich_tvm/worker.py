"""`python -m sandwich_tvm.worker`: see sandwich_tvm.cli.worker."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("cli.worker"))
