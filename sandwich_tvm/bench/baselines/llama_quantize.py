"""llama.cpp's ``llama-quantize`` and ``llama-imatrix``: its own 4-bit weights and importance
matrices, for the perplexity benchmark to set beside ours on the same GGUF.

``requantize`` makes a GGUF of another weight type from a GGUF (``--allow-requantize``: the
source may itself be quantized, as SmolLM2's Q4_1 is), with an importance matrix when given,
as llama.cpp users run it. ``make_imatrix`` runs ``llama-imatrix`` over a text with the thread
count given and writes its GGUF form. Both are built by ``bash scripts/build_llama_server.sh``.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from .llamaserver import find_tool, tool_unavailable

QUANTIZE, QUANTIZE_ENV = "llama-quantize", "LLAMA_QUANTIZE"
IMATRIX, IMATRIX_ENV = "llama-imatrix", "LLAMA_IMATRIX"


class LlamaToolError(RuntimeError):
    """A llama.cpp tool is missing or failed; the message has the tail of its output."""


def _run(name: str, env: str, args: list[str], timeout: float) -> float:
    binary = find_tool(name, env)
    if binary is None:
        raise LlamaToolError(tool_unavailable(name, env))
    cmd = [str(binary), *args]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace",
                              timeout=timeout, check=False)
    except (subprocess.TimeoutExpired, OSError) as err:
        raise LlamaToolError(f"{name} did not finish ({err}): {' '.join(cmd)}") from err
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-4:])
        raise LlamaToolError(f"{name} failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    return time.perf_counter() - t0


def requantize(src: Path, dst: Path, qtype: str, *, threads: int, imatrix: Path | None = None,
               timeout: float = 1800.0) -> list[str]:
    """``src`` as a GGUF of ``qtype`` (``q4_0``...) at ``dst``; returns the command (paths named)."""
    args = ["--allow-requantize", *(["--imatrix", str(imatrix)] if imatrix else []),
            str(src), str(dst), qtype.upper(), str(threads)]
    _run(QUANTIZE, QUANTIZE_ENV, args, timeout)
    return [QUANTIZE, *args]


def make_imatrix(model: Path, text: str, out: Path, *, n_ctx: int, chunks: int, threads: int,
                 timeout: float = 3600.0) -> tuple[list[str], float]:
    """Run ``llama-imatrix`` on ``chunks`` chunks of ``n_ctx`` tokens of ``text``; the GGUF
    importance matrix is written to ``out`` (through a temporary name: a failed run leaves none)."""
    with tempfile.TemporaryDirectory(prefix="sandwich-imatrix-") as tmp:
        text_file, part = Path(tmp) / "calibration.txt", Path(tmp) / "imatrix.gguf"
        text_file.write_text(text, encoding="utf-8")
        args = ["-m", str(model), "-f", str(text_file), "-c", str(n_ctx), "--chunks", str(chunks),
                "-t", str(threads), "-o", str(part)]
        seconds = _run(IMATRIX, IMATRIX_ENV, args, timeout)
        if not part.is_file():
            raise LlamaToolError(f"{IMATRIX} finished but wrote no {part.name}")
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_name(out.name + ".tmp")
        staged.write_bytes(part.read_bytes())
        staged.replace(out)
    return [IMATRIX, *args[:3], "TEXT", *args[4:-1], str(out)], seconds
