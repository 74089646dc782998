"""Huge-page buffers and the check that reports whether the weights got them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.memory import HUGE_PAGE, aligned_empty, huge_page_share

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    try:
        text = THP.read_text()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off")
def test_large_buffers_land_in_huge_pages_and_the_share_says_so():
    big = aligned_empty((16 * HUGE_PAGE // 4,))
    big[...] = 1.0  # fault the pages in
    assert big.ctypes.data % HUGE_PAGE == 0
    share = huge_page_share([big])
    assert share is not None and share > 0.5  # 16 huge pages plus one page of slack
    small = np.ones(1 << 16, np.float32)  # 256 KiB on the heap: never a huge page
    both = huge_page_share([big, small])
    assert both is not None and both < share
    assert huge_page_share([]) is None


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off")
def test_collapse_backs_filled_buffers_with_huge_pages_and_keeps_their_values():
    from sandwich_tvm.memory import collapse_huge_pages

    big = aligned_empty((4 * HUGE_PAGE + 100,), "uint8")
    big[...] = np.arange(big.size) % 251
    small = np.ones(10, np.float32)
    done = collapse_huge_pages([big, small])
    np.testing.assert_array_equal(big, np.arange(big.size) % 251)  # the data is kept
    assert done in (0, 5 * HUGE_PAGE)  # every 2 MiB block of the array, or none (an older kernel)
    if done:
        assert huge_page_share([big]) == 1.0
