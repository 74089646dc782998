"""llama.cpp's own ``llama-server`` as the serving benchmark's baseline: the same weights as a
GGUF in the same dtype (F32, F16 or BF16), the same thread count, ``slots`` parallel sequences
under continuous batching.

The binary is built from source by ``bash scripts/build_llama_server.sh`` (minutes) into
``.venv/bin/llama-server``. Start it with :class:`~.server_process.ServerProcess` and the
command from :func:`llama_server_command`; it serves OpenAI's ``POST /v1/completions``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .llamacpp import gguf_for

__all__ = ["BUILD_HINT", "find_llama_server", "find_tool", "gguf_for", "llama_server_command",
           "tool_unavailable", "unavailable"]

BUILD_HINT = ("run `bash scripts/build_llama_server.sh` (builds llama-server, llama-perplexity, "
              "llama-quantize and llama-imatrix into .venv/bin, minutes)")


def find_tool(name: str, env: str) -> Path | None:
    """A llama.cpp tool the build script installs: ``$ENV`` when set, else ``name`` next to this
    interpreter (the venv's ``bin/``), else the first on ``PATH``; None when none runs."""
    given = os.environ.get(env)
    if given:
        return Path(given) if _executable(Path(given)) else None
    local = Path(sys.executable).parent / name  # not resolved: a venv's python is a link
    if _executable(local):
        return local
    found = shutil.which(name)
    return Path(found) if found else None


def tool_unavailable(name: str, env: str) -> str | None:
    """None when ``find_tool`` finds it, else why not and how to get it."""
    if find_tool(name, env) is not None:
        return None
    given = os.environ.get(env)
    if given:
        return f"{name} not found: {env}={given} is not an executable file; {BUILD_HINT}"
    return f"{name} not found (not in {Path(sys.executable).parent} nor on PATH): {BUILD_HINT}"


def find_llama_server() -> Path | None:
    """The ``llama-server`` binary (``$LLAMA_SERVER`` first; see ``find_tool``)."""
    return find_tool("llama-server", "LLAMA_SERVER")


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def unavailable() -> str | None:
    """None when llama-server is found, else why not and how to get it."""
    return tool_unavailable("llama-server", "LLAMA_SERVER")


def llama_server_command(binary: Path | str, gguf: Path | str, *, threads: int, slots: int,
                         context_per_slot: int, port: int, host: str = "127.0.0.1",
                         locked: bool = False) -> list[str]:
    """The llama-server command line: its defaults except what the comparison fixes.

    ``locked``: ``--mlock --no-mmap``, the weights read into memory llama.cpp allocates and
    locks instead of mapped from the GGUF (the default: page-cache pages, 4 KiB).

    ``-c`` is the whole KV cache, which llama-server splits evenly across the ``-np`` slots:
    with ``-np`` given, ``kv_unified`` stays off (only the automatic slot count turns it on,
    tools/server/server.cpp), so each sequence gets ``n_ctx / n_seq_max`` rounded up to a
    multiple of 256 (``llama_context``, src/llama-context.cpp) and capped at the model's
    training context (``n_ctx_slot()``, tools/server/server-context.cpp). Continuous batching
    is on by default (``common_params::cont_batching = true``; ``-cb`` in ``--help``), so it
    needs no flag. ``-tb`` sets the prompt-processing threads, which otherwise default to
    ``-t``'s; given both so neither side depends on that default.
    """
    if threads < 1 or slots < 1 or context_per_slot < 1:
        raise ValueError(f"threads, slots and context_per_slot must be >= 1, got {threads}, {slots}, "
                         f"{context_per_slot}")
    return [str(binary), "-m", str(gguf),
            "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(slots * context_per_slot),
            "--host", host, "--port", str(port), *(["--mlock", "--no-mmap"] if locked else [])]
