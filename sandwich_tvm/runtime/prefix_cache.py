"""Prefix caching: full KV pages found again by their tokens (vLLM's block hashing).

Every full page of a sequence in the KV cache is keyed by a hash of its tokens and of the key
of the page before it, so one key names a whole prefix. Running sequences are indexed as their
pages fill; a finished sequence stays in the cache as an *entry* (its pages held, least recently
used first) until pages run short. A new prompt walks its pages' keys; the deepest hit names a
sequence whose first pages hold exactly that prefix, and the new sequence is forked from it
(``KVPages.fork``, TVM's ``fork_sequence``): it shares those pages and prefills only the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .pages import KVPages


class PrefixCache:
    """The page-key index over the KV cache's sequences, and the finished ones kept (LRU)."""

    def __init__(self, pages: KVPages):
        self.pages, self.page_size = pages, pages.page_size
        self._index: dict[int, dict[int, None]] = {}  # page key -> kv ids holding that prefix
        self._keys: dict[int, list[int]] = {}  # kv id -> its full pages' keys
        self._tokens: dict[int, Sequence[int]] = {}  # kv id -> its tokens (the cached ones lead)
        self.entries: OrderedDict[int, None] = OrderedDict()  # finished, least recently used first
        self.hit_tokens = 0
        self.query_tokens = 0

    def _key(self, prev: int, tokens: Sequence[int], page: int) -> int:
        return hash((prev, tuple(tokens[page * self.page_size:(page + 1) * self.page_size])))

    def index(self, kv_id: int, tokens: Sequence[int], cached: int) -> None:
        """``kv_id``'s first ``cached`` of ``tokens`` are in the cache: key its full pages."""
        keys = self._keys.setdefault(kv_id, [])
        self._tokens[kv_id] = tokens
        for page in range(len(keys), cached // self.page_size):
            key = self._key(keys[-1] if keys else 0, tokens, page)
            keys.append(key)
            self._index.setdefault(key, {})[kv_id] = None

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(kv id, cached tokens) of the longest whole-page prefix of ``tokens`` in the cache,
        leaving at least one token to compute (its logits sample the next); None if no page."""
        best, key, page = None, 0, 0
        while (page + 1) * self.page_size < len(tokens):
            key = self._key(key, tokens, page)
            holders = self._index.get(key)
            if not holders:
                break
            best = (next(reversed(holders)), (page + 1) * self.page_size)
            page += 1
        if best is None:
            return None
        kv_id, n = best
        if list(self._tokens[kv_id][:n]) != list(tokens[:n]):  # a hash collision: trust nothing
            return None
        return best

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """``match``, counted in the hit statistics; an entry used is the most recently used."""
        found = self.match(tokens)
        self.query_tokens += len(tokens)
        if found is not None:
            self.hit_tokens += found[1]
            if found[0] in self.entries:
                self.entries.move_to_end(found[0])
        return found

    def keep(self, kv_id: int) -> None:
        """A finished sequence stays cached as an entry (the most recently used)."""
        self.entries[kv_id] = None

    def forget(self, kv_id: int) -> None:
        """``kv_id`` leaves the KV cache: drop its keys (and its entry)."""
        for key in self._keys.pop(kv_id, []):
            holders = self._index[key]
            holders.pop(kv_id, None)
            if not holders:
                del self._index[key]
        self._tokens.pop(kv_id, None)
        self.entries.pop(kv_id, None)

    def oldest(self) -> int | None:
        """The least recently used entry (the next to evict), None when there is none."""
        return next(iter(self.entries), None)

    def clear(self) -> None:
        self._index.clear()
        self._keys.clear()
        self._tokens.clear()
        self.entries.clear()
