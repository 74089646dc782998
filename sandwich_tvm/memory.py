"""Host memory for data that is streamed: 64-byte aligned, in 2 MiB pages when large.

TVM refuses DLPack tensors that are not 64-byte aligned, and decode streams every weight
once per token, which runs ~1.4x faster from transparent huge pages (notes §8). Anonymous
``mmap`` memory advised ``MADV_HUGEPAGE`` gets them when THP is in ``madvise`` mode.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import numpy as np

HUGE_PAGE = 2 << 20


def aligned_empty(shape: Iterable[int], dtype: str = "float32") -> np.ndarray:
    """A writable array at a 64-byte (small) or 2 MiB-page (large, ``MADV_HUGEPAGE``) boundary."""
    shape = tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < HUGE_PAGE:
        raw = np.empty(nbytes + 64, dtype=np.uint8)
        off = (-raw.ctypes.data) % 64
        return raw[off:off + nbytes].view(dtype).reshape(shape)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(buf, dtype=np.uint8)
    off = (-whole.ctypes.data) % HUGE_PAGE
    return whole[off:off + nbytes].view(dtype).reshape(shape)


MADV_COLLAPSE = 25  # Linux 6.1+: collapse a range into huge pages now (mmap lacks it on 3.11)


def collapse_huge_pages(arrays: Iterable[np.ndarray]) -> int:
    """Ask Linux to back the 2 MiB-page arrays (``aligned_empty``'s large ones, filled) with
    transparent huge pages *now* (``MADV_COLLAPSE``): at fault time THP ``madvise`` mode gets a
    huge page only where a free 2 MiB block is at hand (on a long-running VM part of a 1B model's
    weights missed them), and khugepaged collapses the rest only later, while decode streams the
    weights every token. Best effort: returns the bytes collapsed; an older
    kernel or a refusal changes nothing."""
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    asked = 0
    for a in arrays:
        if a.nbytes < HUGE_PAGE or a.ctypes.data % HUGE_PAGE:
            continue
        size = -(-a.nbytes // HUGE_PAGE) * HUGE_PAGE
        if madvise(a.ctypes.data, size, MADV_COLLAPSE) == 0:
            asked += size
    return asked


def huge_page_share(arrays: Iterable[np.ndarray]) -> float | None:
    """Fraction of the arrays' bytes backed by transparent huge pages: each array weighs its
    bytes by the huge-page share (``AnonHugePages`` / ``Rss`` in ``/proc/self/smaps``) of the
    mapping it lives in, so a few small arrays on the heap count their bytes, not the whole heap's
    pages; None where unreadable.

    Decode streams every weight once per token, and 4 KiB pages make that ~1.4x slower, so a
    low share explains a slow run (THP ``madvise`` mode gives huge pages only where the kernel
    can find free 2 MiB blocks at fault time)."""
    sized = [(a.ctypes.data, a.nbytes) for a in arrays if a.nbytes]
    if not sized:
        return None
    try:
        with open("/proc/self/smaps") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    maps: list[list[int]] = []  # [lo, hi, rss KiB, huge KiB]
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            maps.append([*(int(x, 16) for x in head.split("-")), 0, 0])
        elif maps and head == "Rss:":
            maps[-1][2] = int(line.split()[1])
        elif maps and head == "AnonHugePages:":
            maps[-1][3] = int(line.split()[1])
    total = huge = 0.0
    for start, nbytes in sized:
        where = next((m for m in maps if m[0] <= start < m[1] and m[2]), None)
        if where is not None:
            total += nbytes
            huge += nbytes * where[3] / where[2]
    return huge / total if total else None
