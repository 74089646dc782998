"""Request traces: ShareGPT sampling and explicit lengths."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.topology.trace import parse_lengths, sample_sharegpt


def test_sharegpt_sample_is_filtered_and_reproducible():
    trace = sample_sharegpt(32, max_context=1024, seed=3)
    assert len(trace.prompt) == 32
    assert np.all(trace.prompt >= 4) and np.all(trace.output >= 4)
    assert np.all(trace.prompt + trace.output <= 1024)
    again = sample_sharegpt(32, max_context=1024, seed=3)
    assert np.array_equal(trace.prompt, again.prompt)


def test_parse_lengths():
    trace = parse_lengths("128:64,512:128")
    assert trace.prompt.tolist() == [128, 512] and trace.output.tolist() == [64, 128]
    for bad in ("128", "a:b", "0:5"):
        with pytest.raises(ValueError):
            parse_lengths(bad)
