"""Streamed text: incremental detokenization into deltas, and stop strings across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..model.tokenizer import byte_piece, decoder_uses


class Decoder(Protocol):
    """What detokenization needs: ``tokenizers.Tokenizer`` and ``ModelTokenizer`` both fit."""

    def decode(self, ids: list[int]) -> str: ...


class Detokenizer:
    """Token ids in, text deltas out, as vLLM's detokenizer does.

    Each step decodes the tokens since the last emitted boundary with the previous window as
    context (so SentencePiece's leading spaces come out right), and holds back text ending in
    U+FFFD: a multi-byte character whose remaining bytes a later token brings. A byte-level BPE
    decodes such a tail to one U+FFFD, so two in a row are an invalid byte no token completes,
    and go out. SentencePiece's byte fallback (one token a byte) turns every byte of a run it
    cannot decode into U+FFFD, so there the hold ends after ``MAX_PENDING`` byte tokens (a
    character has at most four bytes). The deltas concatenate to the decode of all the ids.
    """

    MAX_PENDING = 3

    def __init__(self, tok: Decoder):
        self.tok = tok
        self.ids: list[int] = []  # only the window still needed: ids[prefix:read] is context
        self.prefix = self.read = 0
        self.byte_fallback = decoder_uses(tok, "ByteFallback")
        self._is_byte: dict[int, bool] = {}

    def push(self, token: int) -> str:
        """The text ``token`` completes (often "", e.g. inside a multi-byte character)."""
        self.ids.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD here)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        # A trailing U+FFFD may be a character whose last bytes come later (see the class notes).
        if self.byte_fallback:
            incomplete = text.endswith("\ufffd") and 0 < self._trailing_bytes() <= self.MAX_PENDING
        else:
            incomplete = text.endswith("\ufffd") and not text.endswith("\ufffd\ufffd")
        if not final and (len(text) <= len(before) or incomplete):
            return ""
        # Keep only the new context window: older ids never take part in a decode again.
        self.ids = self.ids[self.read:]
        self.prefix, self.read = 0, len(self.ids)
        return text[len(before):]

    def _trailing_bytes(self) -> int:
        """How many of the ids not yet emitted, counted from the end, are byte pieces (``<0xNN>``)."""
        raw = getattr(self.tok, "tok", self.tok)
        n = 0
        for t in reversed(self.ids[self.read:]):
            if t not in self._is_byte:
                piece = raw.id_to_token(t) if hasattr(raw, "id_to_token") else None
                self._is_byte[t] = piece is not None and byte_piece(piece) is not None
            if not self._is_byte[t]:
                break
            n += 1
        return n


class StopMatcher:
    """Finds stop strings in streamed text, even when one spans several deltas.

    ``feed`` returns the text safe to emit now: a suffix that could begin a stop string is held
    back until the next delta settles it. When a stop string appears, the emitted text ends
    right before it (the stop string and everything after it are dropped, as OpenAI and vLLM
    do) and the matcher is done. With no stop strings, text passes straight through.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """``(text to emit, whether a stop string was found)``; after a stop, always ``("", True)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self.pending + delta
        # Any stop string that starts in the text already emitted would have been held back, so
        # searching the pending text is enough; the earliest match wins.
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[:min(hits)], True
        hold = self._held(text)
        self.pending = text[len(text) - hold:]
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The held-back text, at the end of a stream that hit no stop string."""
        text, self.pending = self.pending, ""
        return text

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = max(len(s) for s in self.stops) - 1
        for n in range(min(longest, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
