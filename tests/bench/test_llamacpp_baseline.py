"""The llama.cpp baseline runs the same model: its greedy tokens equal HF's (optional extra)."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.model.checkpoint import read_checkpoint
from sandwich_tvm.model.config import load_config

from ..model.hf_models import write_hf_model

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied-llama3", "mha-yarn"])
def test_gguf_export_generates_hf_tokens(name, tmp_path):
    from sandwich_tvm.bench.baselines.llamacpp import LlamaCpp, write_gguf

    hf = write_hf_model(name, tmp_path / "hf")
    cfg = load_config(tmp_path / "hf")
    path = write_gguf(cfg, read_checkpoint(tmp_path / "hf"), tmp_path / "model.gguf")
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, cfg.vocab_size, 20)]
    _, _, tokens = LlamaCpp(path, threads=2, context=64).generate(prompt, 8)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].argmax(-1).tolist()
    assert tokens == ref
