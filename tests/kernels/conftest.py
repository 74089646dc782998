"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

ROTATION_BYTES = 1 << 20


@pytest.fixture
def small_rotation(monkeypatch):
    """The tuner's runner rotates over 1 MiB of weight copies instead of twice the last-level
    cache (thousands of copies of a test's small weight, each call of them timed): tests of what
    the search keeps and resumes need its timings to order candidates, not to come from DRAM."""
    from sandwich_tvm.kernels.metaschedule import runner

    monkeypatch.setattr(runner, "cold_weight_bytes", lambda: ROTATION_BYTES)
