"""Importance matrices: llama.cpp's ``llama-imatrix`` files, read for weights quantized at load.

An importance matrix holds, per Linear weight, the mean square of the activations that meet
each input column (k) over some calibration text. Quantizing a 4-bit type with it
(``kernels.quant.weighted_blocks``) spends the rounding error where activations are small,
as ``llama-quantize --imatrix`` does. The file is llama.cpp's GGUF form: for a weight named
``blk.0.attn_q.weight``, an F32 tensor ``blk.0.attn_q.weight.in_sum2`` (the sum of squares
per k) and ``...counts`` (how many activations were summed). Write one with
``llama-imatrix -m MODEL.gguf -f TEXT -o FILE.gguf`` or ``python -m sandwich_tvm.bench imatrix``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .checkpoint import ModelLoadError
from .config import LlamaConfig
from .gguf import hf_name

SUM2, COUNTS = ".in_sum2", ".counts"
# Our fused Linears read the importance of the first weight they hold: the same input.
FUSED_SOURCE = {"self_attn.qkv_proj.weight": "self_attn.q_proj.weight",
                "mlp.gate_up_proj.weight": "mlp.gate_proj.weight"}


class ImatrixError(ModelLoadError):
    """An importance matrix that cannot be used; the message says what to do."""


def read_imatrix(path: Path | str, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """HF weight name -> mean squared activation per k, for every Linear of ``cfg`` the file has.

    A file that is not a GGUF importance matrix, or whose vectors do not fit ``cfg``'s weights
    (another model's), raises ``ImatrixError``."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ImatrixError(f"--imatrix {path}: no such file; write one with llama-imatrix -o FILE.gguf")
    try:
        reader = gguf.GGUFReader(str(path))
        tensors = {t.name: np.asarray(t.data, np.float32).reshape(-1) for t in reader.tensors}
    except (ValueError, OSError, KeyError, IndexError, TypeError) as err:
        raise ImatrixError(f"--imatrix {path} is not a GGUF importance matrix ({err}); llama-imatrix "
                           "writes one when its -o name ends in .gguf") from None
    out: dict[str, np.ndarray] = {}
    for name, sums in tensors.items():
        if not name.endswith(SUM2):
            continue
        weight = name[:-len(SUM2)]
        counts = tensors.get(weight + COUNTS)
        hf = hf_name(weight, cfg.fused_checkpoint)
        if counts is None or counts.size != 1 or not counts[0] > 0:
            raise ImatrixError(f"--imatrix {path}: {weight} has no positive {COUNTS}; the file is damaged, "
                               "write it again with llama-imatrix")
        if hf is None or not hf.startswith("model.layers."):
            continue  # the output layer's: ours is q8_0, quantized without one
        layer = int(hf.split(".")[2])
        if layer >= cfg.num_hidden_layers:
            raise ImatrixError(f"--imatrix {path}: {weight} is past {cfg.name}'s {cfg.num_hidden_layers} "
                               "layers; the file was made for another model")
        k = _input_size(cfg, hf)
        if sums.size != k or not np.all(np.isfinite(sums)):
            raise ImatrixError(f"--imatrix {path}: {weight} holds {sums.size} values, but {cfg.name}'s takes "
                               f"{k} inputs; the file was made for another model")
        out[hf] = np.maximum(sums / counts[0], 0.0).astype(np.float32)
    if not out:
        raise ImatrixError(f"--imatrix {path} holds no importance of a layer's weight (no blk.N.*.in_sum2); "
                           "write it with llama-imatrix for this model")
    return out


def _input_size(cfg: LlamaConfig, hf: str) -> int:
    if hf.endswith("mlp.down_proj.weight"):
        return cfg.intermediate_size
    if hf.endswith("self_attn.o_proj.weight"):
        return cfg.num_attention_heads * cfg.head_dim
    return cfg.hidden_size


def importance_of(table: dict[str, np.ndarray] | None, name: str) -> np.ndarray | None:
    """The importance vector of our parameter ``name`` (fused ones read their first part's, unless
    the checkpoint held them fused)."""
    if not table:
        return None
    if name in table:
        return table[name]
    for fused, source in FUSED_SOURCE.items():
        if name.endswith(fused):
            return table.get(name[:-len(fused)] + source)
    return table.get(name)


def imatrix_digest(path: Path | str) -> str:
    """The file's content hash, for the conversion cache key."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
