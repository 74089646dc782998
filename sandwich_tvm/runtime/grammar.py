"""Constrained decoding: a request's grammar masks its logits at every step (llguidance).

``Grammars`` wraps the model's tokenizer for llguidance once (``LLTokenizer``, built on first
use) and compiles a grammar (llguidance's JSON form, made from a JSON schema, a regex or a Lark
grammar by ``grammar_from_*``) before the request is queued, so a bad one is the client's
error, not the batch's. ``Constraint`` is one request's matcher: ``mask`` sets the logits of
tokens the grammar does not allow next to -inf, ``accept`` advances it by the sampled token.
Masks are computed on the engine thread per constrained sequence only; the time they take is
measured (``ServingMetrics.grammar_mask``), and unconstrained sequences in the same step pay
nothing else.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence

import numpy as np


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong."""


def grammar_from_json_schema(schema: dict | str) -> str:
    """llguidance's grammar for JSON values that validate against ``schema``, written compactly
    (``", "`` and ``": "`` between items; no free whitespace for a model to loop in, as llama.cpp
    bounds it)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as err:
        raise GrammarError(f"the JSON schema is not a JSON object: {err}") from err


def grammar_from_regex(regex: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(regex)


def grammar_from_lark(lark: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(lark)


def grammar_from_choice(choices: Sequence[str]) -> str:
    """Exactly one of ``choices``."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("a choice constraint needs a non-empty list of strings")
    return grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices))


class Constraint:
    """One request's grammar state over the model's vocabulary."""

    def __init__(self, matcher, vocab_size: int):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher, self.vocab_size = matcher, vocab_size
        self._bitmask = allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> np.ndarray:
        """Which tokens the grammar allows next, ``[vocab]`` bool."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].astype(bool)

    def mask(self, logits: np.ndarray) -> None:
        """Disallowed tokens' logits to -inf, in place."""
        logits[~self.allowed()] = -np.inf

    def accept(self, token: int) -> None:
        self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


def grammar_ending(constraint: Constraint) -> tuple[str, str | None] | None:
    """How a constrained sequence ends after its last token: ``("error", why)`` when the matcher
    failed (a parser limit; it then reports stopped too), ``("stop", None)`` when the grammar is
    complete, None while it goes on."""
    if constraint.error:
        return "error", f"the output grammar failed: {constraint.error}"
    return ("stop", None) if constraint.done else None


class Grammars:
    """Compiles and checks constraints for one tokenizer (``tokenizers.Tokenizer``)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self._tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltok = None
        self._lock = threading.Lock()

    @property
    def lltok(self):
        with self._lock:
            if self._lltok is None:
                from llguidance import LLTokenizer

                self._lltok = LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab_size,
                                          eos_token=self.eos_ids or None)
            return self._lltok

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher for ``grammar``; ``GrammarError`` (its first line) if it does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip().splitlines()[0])
        return Constraint(matcher, self.vocab_size)
