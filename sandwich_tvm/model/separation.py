"""Weight-attention separation in the model file: the cache-resident paper's second plan
dimension (section 4), attention and the paged KV cache on a rank of their own.

A separated model runs as two processes over one layer loop. The weight rank holds every
parameter and runs the weight-centric operators (embedding, norms, QKV, O, the MLP and the
head); where a layer attends, it hands its fused QKV to the attention rank and takes the
attention output back (``attend_remote``). The attention rank holds the KV cache (RoPE, the
cache's append, the attention kernels) and no weights: its functions (``AttentionRank``) take
each layer's QKV, attend, and give the output back, layer after layer. The KV pages live on the
attention rank, so the weights and the keys/values never share a cache or a memory domain.

The hand-offs are the process group's shared-memory all-reduce (``runtime.tp_worker``
registers the functions named here): the rank that has nothing to send adds zeros, so both
ranks get the sender's tensor bit for bit. Each rank's functions chain the hand-offs through
their data (a reply feeds the next layer's receive), so no pass can drop or reorder them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from ..kernels.kv_int8 import dequantize_rows_primfunc, quantize_rows_primfunc, row_width
from .config import LlamaConfig

WA_ATTEND = "sandwich.wa_attend"  # weight rank (qkv, out): qkv to the attention rank, its output back
WA_RECEIVE = "sandwich.wa_receive"  # attention rank (after, out): the weight rank's next qkv
WA_REPLY = "sandwich.wa_reply"  # attention rank (x, out): x to the weight rank; out: a zero marker
WEIGHTS, ATTENTION = "weights", "attention"
ACT_DTYPE = "float32"  # activations, norms, RoPE, softmax and accumulation; weights and KV have their own


@dataclass(frozen=True)
class Role:
    """The side of a separated model a process runs: ``weights`` or ``attention``."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in (WEIGHTS, ATTENTION):
            raise ValueError(f"a separated model's role is {WEIGHTS!r} or {ATTENTION!r}, not {self.name!r}")

    def to_json(self) -> dict:
        return {"name": self.name}


def attend_remote(qkv: nn.Tensor, heads: int, head_dim: int) -> nn.Tensor:
    """The weight rank's attention: ``qkv`` ``[b, s, (heads + 2 kv_heads) * d]`` to the
    attention rank, its output ``[b, s, heads * d]`` back."""
    b, s = qkv.shape[0], qkv.shape[1]
    return op.extern(WA_ATTEND, [qkv], out=nn.Tensor.placeholder((b, s, heads * head_dim), ACT_DTYPE))


def kv_rows(func: tirx.PrimFunc, x: nn.Tensor, heads: int, dtype: str, width: int) -> nn.Tensor:
    """``x`` (b, s, heads, ·) through the row kernel ``func``: into or out of the int8 cache's
    row format."""
    b, s = x.shape[0], x.shape[1]
    flat = op.reshape(x, (b * s, heads, x.shape[3]))
    y = op.tensor_ir_op(func, func.attrs["global_symbol"], args=[flat],
                        out=nn.Tensor.placeholder((b * s, heads, width), dtype))
    return op.reshape(y, (b, s, heads, width))


def attend_cache(kv: PagedKVCache, layer_id: int, qkv: nn.Tensor, heads: int, kv_dtype: str,
                 sm_scale: float) -> nn.Tensor:
    """Attention of layer ``layer_id`` over the paged cache, q.k times ``sm_scale``: ``qkv``
    ``[b, s, heads + 2 kv_heads, d]`` (fp32) stored as the cache's ``kv_dtype``, the output
    ``[b, s, heads, d]`` in fp32."""
    all_heads, d = int(qkv.shape[2]), int(qkv.shape[3])
    if kv_dtype == "int8":  # int8 rows with their scales (kernels.kv_int8)
        qkv = kv_rows(quantize_rows_primfunc(all_heads, d), qkv, all_heads, "int8", row_width(d, "int8"))
    elif kv_dtype != ACT_DTYPE:  # the cache stores (and its kernels read) 16-bit K/V
        qkv = op.astype(qkv, kv_dtype)
    out = kv.attention_with_fused_qkv(layer_id, qkv, heads, sm_scale=sm_scale)
    if kv_dtype == "int8":
        return kv_rows(dequantize_rows_primfunc(heads, d), out, heads, ACT_DTYPE, d)
    return op.astype(out, ACT_DTYPE) if kv_dtype != ACT_DTYPE else out


class AttentionRank(nn.Module):
    """The attention rank's model: per layer, the weight rank's QKV in, attention over this
    rank's paged KV cache (stored as ``kv_dtype``), the output back. No parameters. Its functions
    take the token ids (only their shape is read) and return a zero marker where the weight
    rank returns logits."""

    def __init__(self, cfg: LlamaConfig, kv_dtype: str = "float32"):
        self.cfg, self.kv_dtype = cfg, kv_dtype
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim

    def _layer(self, after: nn.Tensor, kv: PagedKVCache, layer_id: int, b, s) -> nn.Tensor:
        d, heads = self.head_dim, self.heads + 2 * self.kv_heads
        qkv = op.extern(WA_RECEIVE, [after], out=nn.Tensor.placeholder((b, s, heads * d), ACT_DTYPE))
        out = attend_cache(kv, layer_id, op.reshape(qkv, (b, s, heads, d)), self.heads, self.kv_dtype,
                           self.cfg.attention_scale)
        out = op.reshape(out, (b, s, self.heads * d))
        return op.extern(WA_REPLY, [out], out=nn.Tensor.placeholder((b, s, 1), ACT_DTYPE))

    def _forward(self, ids: nn.Tensor, kv: PagedKVCache) -> nn.Tensor:
        b, s = ids.shape[0], ids.shape[1]
        after = op.astype(op.reshape(ids, (b, s, 1)), ACT_DTYPE)  # the first receive's input
        for i in range(self.cfg.num_hidden_layers):
            after = self._layer(after, kv, i, b, s)
        return after

    def prefill(self, input_ids: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_ids, paged_kv_cache), paged_kv_cache

    def decode(self, input_ids: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_ids, paged_kv_cache), paged_kv_cache

    def batch_prefill(self, input_ids: nn.Tensor, logit_positions: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_ids, paged_kv_cache), paged_kv_cache

    def batch_decode(self, input_ids: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_ids, paged_kv_cache), paged_kv_cache

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        from .llama import native_stderr_off, paged_kv_cache

        with native_stderr_off() if self.kv_dtype == "int8" else contextlib.nullcontext():
            return paged_kv_cache(self.cfg, self.cfg.num_hidden_layers, self.kv_dtype, 1, max_batch_size,
                                  max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window)

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        from .llama import model_spec

        return model_spec(self, token_inputs=True, head=False)
