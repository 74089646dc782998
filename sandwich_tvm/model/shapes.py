"""The Linear GEMMs of a Llama model (weights fused as the model stores them)."""

from __future__ import annotations

from collections.abc import Iterable

from ..host import cpu_flags
from ..kernels.codegen import fuses_silu_mul
from ..kernels.microkernel import kernel_isa
from ..kernels.quant import head_dtype
from ..kernels.schedule import GemmShape
from ..tvm_compat import host_isa
from .config import LlamaConfig


def linear_shapes(cfg: LlamaConfig, dtype: str = "float32", tp: int = 1,
                  isa: str | None = None, wider: Iterable[tuple[int, str, str]] = ()) -> dict[str, GemmShape]:
    """qkv, o, gate_up, down and lm_head as ``Y = X @ W.T`` shapes (n = output, k = input features),
    of one rank's shard when the model is split over ``tp`` processes (the paper's payload
    generator: shapes from the config and the TP degree), each with the epilogue the model
    fuses into it on ``isa``'s micro-kernels (default: this host's for ``dtype``).

    o and down add the residual (when split, the all-reduce adds it instead); gate_up applies
    silu(gate) * up where its columns interleave in whole vectors. The lm_head only ever sees
    decode-sized m (prefill computes the last token's logits). ``wider``: the (layer, Linear,
    dtype) a GGUF holds wider than ``dtype`` (``RunSpec.wider_linears``), each such (Linear,
    dtype) one more shape, named ``"down q8_0"``, with the epilogue its Linear has."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d // tp, cfg.num_key_value_heads * d // tp
    inter = cfg.intermediate_size // tp
    isa = kernel_isa(host_isa(), dtype, cpu_flags()) if isa is None else isa
    residual = "residual" if tp == 1 else "none"
    shapes = {
        "qkv": GemmShape(q + 2 * kv, h, dtype),
        "o": GemmShape(h, q, dtype, residual),
        "gate_up": GemmShape(2 * inter, h, dtype, "silu_mul" if fuses_silu_mul(inter, isa) else "none"),
        "down": GemmShape(h, inter, dtype, residual),
        "lm_head": GemmShape(-(-cfg.vocab_size // tp), h, head_dtype(dtype)),
    }
    for _, name, wide in sorted(wider):
        base = shapes[name]
        shapes.setdefault(f"{name} {wide}", GemmShape(base.n, base.k, wide, base.epilogue))
    return shapes
