"""Ctrl-C that TVM cannot swallow.

TVM's FFI hands a KeyboardInterrupt raised in one of its Python callbacks back as an error
(at times a bare RuntimeError), and code that reports a failed candidate and goes on would take
it for one. So the CLI notes that Ctrl-C came (``watch``), long loops ask (``check``), and
code that catches broad errors lets them through once it came (``requested``). A process that
has still not stopped ``STOP_GRACE_S`` after the first Ctrl-C prints every thread's stack and
exits with status 1 (``faulthandler``, which needs neither the GIL nor a live main thread).
"""

from __future__ import annotations

import faulthandler
import signal

STOP_GRACE_S = 60.0  # above serve's orderly stop (its tuning worker, then the engine)
_requested = False


def on_sigint(signum, frame) -> None:
    """The SIGINT handler: note the request, arm the hard stop, raise KeyboardInterrupt."""
    global _requested
    if not _requested:
        _requested = True
        try:
            faulthandler.dump_traceback_later(STOP_GRACE_S, exit=True)
        except (AttributeError, ValueError, OSError):  # sys.stderr closed or not a file: fd 2
            faulthandler.dump_traceback_later(STOP_GRACE_S, exit=True, file=2)
    signal.default_int_handler(signum, frame)


def watch() -> None:
    """Install ``on_sigint`` where Ctrl-C still raises Python's KeyboardInterrupt (a background
    process that ignores SIGINT, or a server with handlers of its own, is left as it is)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)


def requested() -> bool:
    """Whether Ctrl-C came since ``watch``."""
    return _requested


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C came, though a callback's error report swallowed it."""
    if _requested:
        raise KeyboardInterrupt
