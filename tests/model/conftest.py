"""Fixtures of the model tests: tiny random HF checkpoints (``hf_models.CONFIGS``)."""

from __future__ import annotations

import pytest

from .hf_models import CONFIGS, hf_checkpoint, write_hf_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_case(request, tmp_path_factory):
    """(model directory, the HF model) for every configuration the model is compared on. The
    directory is the session's one for the configuration (its compiled models can be built
    ahead: ``tests/precompile.py``); each module gets a fresh HF model of the same weights."""
    out = hf_checkpoint(tmp_path_factory.getbasetemp(), request.param)
    return out, write_hf_model(request.param, out)
