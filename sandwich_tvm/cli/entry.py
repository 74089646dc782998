"""Run a CLI module's ``main`` as ``python -m sandwich_tvm.<verb>`` does, with host errors
(an unusable ``TVM_NUM_THREADS``, an unwritable cache) reported as one line, not a traceback."""

from __future__ import annotations

import importlib
import sys

from ..host import HostError


def run(module: str) -> int:
    """Import ``sandwich_tvm.<module>`` (e.g. ``cli.generate``; importing TVM checks the
    environment) and run its ``main``."""
    try:
        return importlib.import_module(f"sandwich_tvm.{module}").main()
    except HostError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
