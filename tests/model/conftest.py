"""Fixtures of the model tests: tiny random HF checkpoints (``hf_models.CONFIGS``)."""

from __future__ import annotations

import pytest

from .hf_models import CONFIGS, write_hf_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_case(request, tmp_path_factory):
    """(model directory, the HF model) for every configuration the model is compared on."""
    out = tmp_path_factory.mktemp(request.param)
    return out, write_hf_model(request.param, out)
