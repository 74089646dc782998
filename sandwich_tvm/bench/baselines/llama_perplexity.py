"""llama.cpp's own ``llama-perplexity`` as the perplexity benchmark's baseline on the same GGUF.

Its protocol (tools/perplexity/perplexity.cpp, ``perplexity()``): the whole text is tokenized
once (a BOS first where the vocabulary adds one), cut into ``n_ctx``-token chunks, each chunk's
first token replaced by BOS (when it adds one), and only the second half of each chunk is
scored: the tokens at positions ``n_ctx/2 + 1 .. n_ctx - 1``. It runs with its defaults and the
thread count given. ``--kl-divergence-base`` makes it write the token ids it scored at the head
of a logits file; they are read back so the other systems score exactly the same tokens.

Built with ``llama-server`` by ``bash scripts/build_llama_server.sh`` into
``.venv/bin/llama-perplexity``.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .llamaserver import find_tool, tool_unavailable

NAME, ENV = "llama-perplexity", "LLAMA_PERPLEXITY"
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_MAGIC = b"_logits_"
_ERROR = re.compile(r"error|failed|need at least|GGML_ASSERT|Unexpected", re.IGNORECASE)


class LlamaPerplexityError(RuntimeError):
    """llama-perplexity did not run, failed, or printed no final estimate."""


@dataclass(frozen=True)
class LlamaPerplexity:
    """One run: its final estimate, the token ids of the chunks it scored and how it ran."""

    ppl: float
    plus_minus: float
    tokens: list[int]  # n_chunk * n_ctx ids as tokenized (before any BOS substitution)
    n_ctx: int
    command: list[str]
    seconds: float

    @property
    def scored(self) -> int:
        return len(self.tokens) // self.n_ctx * (self.n_ctx - self.n_ctx // 2 - 1)


def find_llama_perplexity() -> Path | None:
    """The binary (``$LLAMA_PERPLEXITY`` first; see ``find_tool``)."""
    return find_tool(NAME, ENV)


def unavailable() -> str | None:
    return tool_unavailable(NAME, ENV)


def read_tokens(path: Path) -> tuple[int, list[int]]:
    """``(n_ctx, token ids)`` from the head of a ``--kl-divergence-base`` logits file."""
    try:
        with open(path, "rb") as f:
            magic, head = f.read(8), f.read(12)
            if magic != _MAGIC:
                raise LlamaPerplexityError(f"{path} is not a llama-perplexity logits file")
            if len(head) != 12:
                raise LlamaPerplexityError(f"{path}: truncated header")
            n_ctx, _n_vocab, n_chunk = np.frombuffer(head, np.int32).tolist()
            body = f.read(4 * max(n_ctx * n_chunk, 0))
    except OSError as err:
        raise LlamaPerplexityError(f"llama-perplexity's logits file cannot be read ({err})") from err
    if n_ctx < 2 or n_chunk < 1 or len(body) != 4 * n_ctx * n_chunk:
        raise LlamaPerplexityError(f"{path}: truncated header (n_ctx {n_ctx}, {n_chunk} chunks)")
    return n_ctx, np.frombuffer(body, np.int32).tolist()


def run_llama_perplexity(binary: Path | str, gguf: Path | str, text: str, *, n_ctx: int, chunks: int,
                         threads: int, timeout: float = 3600.0) -> LlamaPerplexity:
    """Score ``chunks`` chunks of ``text`` on ``gguf``; raise ``LlamaPerplexityError`` with the
    tail of its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="sandwich-ppl-") as tmp:
        text_file, logits = Path(tmp) / "text.txt", Path(tmp) / "logits.bin"
        text_file.write_text(text, encoding="utf-8")
        args = ["-c", str(n_ctx), "--chunks", str(chunks), "-t", str(threads)]
        cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), *args, "--kl-divergence-base", str(logits)]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace",
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as err:
            raise LlamaPerplexityError(f"{NAME} ran past {timeout:.0f} s: {' '.join(cmd)}") from err
        except OSError as err:
            raise LlamaPerplexityError(f"{NAME} did not start ({err}): {' '.join(cmd)}") from err
        seconds = time.perf_counter() - t0
        out = done.stdout + done.stderr
        found = _FINAL.search(out)
        if done.returncode != 0 or found is None:
            lines = out.strip().splitlines()
            said = [x for x in lines if _ERROR.search(x)]
            tail = "\n".join(dict.fromkeys(said[-5:] + lines[-3:]))
            raise LlamaPerplexityError(f"{NAME} failed (exit {done.returncode}, no final estimate): "
                                       f"{' '.join(cmd)}\n{tail}")
        got_ctx, ids = read_tokens(logits)
    if got_ctx != n_ctx or len(ids) != n_ctx * chunks:
        raise LlamaPerplexityError(f"{NAME} scored {len(ids) // max(got_ctx, 1)} chunks of {got_ctx} tokens, "
                                   f"not the {chunks} of {n_ctx} asked (too little text?)")
    return LlamaPerplexity(float(found.group(1)), float(found.group(2)), ids, n_ctx,
                           [NAME, "-m", str(gguf), "-f", "TEXT", *args], seconds)


def llama_chunks(ids: Sequence[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """The chunks as llama-perplexity evaluates them: ``n_ctx`` ids each, the first replaced
    by ``bos`` where the vocabulary adds one."""
    out = []
    for i in range(0, len(ids) - n_ctx + 1, n_ctx):
        chunk = list(ids[i:i + n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def second_half(nlls: Sequence[float], chunks: Sequence[Sequence[int]]) -> list[float]:
    """From the NLLs of every position after the first of each chunk (``engine_nll``'s order),
    those llama-perplexity scores: positions ``n/2 + 1 .. n - 1`` of a chunk of ``n``."""
    out, at = [], 0
    for chunk in chunks:
        n = len(chunk)
        out += nlls[at + n // 2:at + n - 1]
        at += n - 1
    if at != len(nlls):
        raise ValueError(f"{len(nlls)} NLLs for chunks that score {at}")
    return out
