"""The paged KV cache's pages as TVM's ``PagedKVCache`` allocates them, sharing included.

TVM keeps each sequence as a chain of blocks of pages; ``fork_sequence`` at a page boundary
makes the child share the parent's leading blocks (reference counted), and a removed sequence
frees only the pages no other sequence holds. ``KVPages`` mirrors that per page: every sequence
holds a list of page ids, a page lives while one sequence holds it. Forks are only ever made at
page boundaries (``fork`` checks), so a shared page is always full and never written again,
and the count here equals the cache's own (``Engine.available_pages``) after every step: the
scheduler plans with it before the cache is asked.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVPages:
    """Page ids per KV sequence id and the number of sequences holding each page."""

    def __init__(self, total: int, page_size: int):
        self.total, self.page_size = total, page_size
        self._pages: dict[int, list[int]] = {}  # kv id -> its pages, first token's page first
        self._length: dict[int, int] = {}  # kv id -> tokens cached
        self._refs: dict[int, int] = {}  # page -> sequences holding it
        self._ids = itertools.count()

    def __contains__(self, kv_id: int) -> bool:
        return kv_id in self._pages

    def length(self, kv_id: int) -> int:
        return self._length[kv_id]

    def free(self) -> int:
        """Pages no sequence holds."""
        return self.total - len(self._refs)

    def held_by(self, kv_ids: Iterable[int]) -> set[int]:
        """The pages any of ``kv_ids`` holds."""
        return {p for k in kv_ids for p in self._pages[k]}

    def prefix_pages(self, kv_id: int, tokens: int) -> list[int]:
        """The pages holding ``kv_id``'s first ``tokens`` (whole pages)."""
        return self._pages[kv_id][:tokens // self.page_size]

    def add(self, kv_id: int) -> None:
        if kv_id in self._pages:
            raise ValueError(f"KV sequence {kv_id} is already cached")
        self._pages[kv_id], self._length[kv_id] = [], 0

    def fork(self, parent: int, child: int, tokens: int) -> None:
        """``child`` starts as ``parent``'s first ``tokens`` (whole pages) without copying them."""
        if tokens % self.page_size or tokens > self._length[parent]:
            raise ValueError(f"a fork shares whole cached pages: {tokens} tokens of {self._length[parent]}, "
                             f"pages of {self.page_size}")
        self.add(child)
        shared = self.prefix_pages(parent, tokens)
        for p in shared:
            self._refs[p] += 1
        self._pages[child], self._length[child] = list(shared), tokens

    def need(self, kv_id: int, n: int) -> int:
        """New pages ``kv_id`` takes to cache ``n`` more tokens."""
        return pages_for(self._length[kv_id] + n, self.page_size) - len(self._pages[kv_id])

    def append(self, kv_id: int, n: int) -> None:
        """Cache ``n`` more tokens of ``kv_id`` (its last page is its own: forks share full pages)."""
        grow = self.need(kv_id, n)
        if grow > self.free():
            raise RuntimeError(f"KV sequence {kv_id} needs {grow} pages, {self.free()} are free")
        for _ in range(grow):
            p = next(self._ids)
            self._refs[p] = 1
            self._pages[kv_id].append(p)
        self._length[kv_id] += n

    def pop(self, kv_id: int, n: int) -> None:
        """Drop ``kv_id``'s last ``n`` tokens (its own pages: they were appended after any fork)."""
        if not 0 <= n <= self._length[kv_id]:
            raise ValueError(f"cannot pop {n} of KV sequence {kv_id}'s {self._length[kv_id]} tokens")
        self._length[kv_id] -= n
        keep = pages_for(self._length[kv_id], self.page_size)
        pages = self._pages[kv_id]
        while len(pages) > keep:
            p = pages.pop()
            self._refs[p] -= 1
            if not self._refs[p]:
                del self._refs[p]

    def remove(self, kv_id: int) -> int:
        """Drop ``kv_id``; the number of pages that became free."""
        freed = 0
        for p in self._pages.pop(kv_id):
            self._refs[p] -= 1
            if not self._refs[p]:
                del self._refs[p]
                freed += 1
        del self._length[kv_id]
        return freed

    def clear(self) -> None:
        self._pages.clear()
        self._length.clear()
        self._refs.clear()
