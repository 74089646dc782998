"""Run a CLI module's ``main`` as ``python -m sandwich_tvm.<verb>`` does, with host errors
(an unusable ``TVM_NUM_THREADS``, an unwritable cache) reported as one line, not a traceback."""

from __future__ import annotations

import atexit
import importlib
import os
import sys

from .. import interrupts
from ..host import HostError

_interrupted = False


def _exit_130_if_interrupted() -> None:
    """The last exit handler: after Ctrl-C, leave with status 130 as the message said.

    CPython sometimes still kills a ``-m`` process with SIGINT at the very end of its
    shutdown after a KeyboardInterrupt the program handled (observed on 3.11, about one run
    in ten), which makes the exit status a coin toss; every other exit handler has run here.
    """
    if _interrupted:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


def _is_interrupt(err: BaseException) -> bool:
    """Whether ``err`` is a KeyboardInterrupt in other clothes: one in its chain, or one TVM's FFI
    carried through C++, whose message holds the Python traceback (naming the interrupt or the
    handler that raised it), or a bare one: the FFI may report it as a RuntimeError with no text."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        text = str(err)
        if (isinstance(err, KeyboardInterrupt) or "KeyboardInterrupt" in text
                or interrupts.on_sigint.__name__ in text or (type(err) is RuntimeError and not text.strip())):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _stopped(message: str = "interrupted") -> int:
    """Ctrl-C ended the command: say so, and leave with status 130 (``_exit_130_if_interrupted``)."""
    global _interrupted
    _interrupted = True
    print(message, file=sys.stderr)
    return 130


def run(module: str) -> int:
    """Import ``sandwich_tvm.<module>`` (e.g. ``cli.generate``; importing TVM checks the
    environment) and run its ``main``."""
    atexit.register(_exit_130_if_interrupted)  # before the imports: runs after their handlers
    interrupts.watch()
    try:
        rc = importlib.import_module(f"sandwich_tvm.{module}").main()
    except HostError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        # a Python callback of TVM's (the tuner's builder, runner, search) interrupted: TVM's FFI
        # hands the KeyboardInterrupt back as a RuntimeError, at times a bare one; the user asked
        # to stop all the same. An error that does not show itself as the interrupt is named.
        if not interrupts.requested():
            raise
        return _stopped("interrupted" if _is_interrupt(err) else
                        f"interrupted ({type(err).__name__} raised while stopping)")
    except KeyboardInterrupt:
        return _stopped()
    if rc and interrupts.requested():  # an error the interrupt caused, reported as the command's own
        return _stopped()
    return rc
