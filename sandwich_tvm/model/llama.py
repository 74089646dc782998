"""Llama 2/3/3.2, TinyLlama, Mistral, Qwen2, Qwen3, Phi-3, Granite and SmolLM3 on ``tvm.relax.frontend.nn``
with TVM's paged KV cache.

The layout follows MLC-LLM's model files: fused ``qkv_proj`` and ``gate_up_proj``, RoPE and
attention inside ``TIRPagedKVCache`` (Llama-3 and linear scaling included; RoPE in the graph for
a model with layers without it, SmolLM3's), and the exported
functions ``prefill``, ``decode``, ``batch_prefill``, ``batch_decode`` and
``create_paged_kv_cache``. With a ``KernelSet`` every Linear calls Sandwich's dynamic-m
kernels on prepacked weights (prefill and decode kernels on the same weight); without one it
uses ``nn.Linear``, which is TVM's stock build. With ``tp`` > 1 it is one rank's part of a
Megatron-sharded model (``parallel``): every rank runs the same code on its own shard. With a
``stage`` it is one pipeline stage's layers (``stages``): hidden states in and out of the
stages after the embedding; the last stage gives the hidden states of the positions asked for,
and the first stage, which embeds the tokens, also exports the head (``head``, and
``decode_head`` on the decode kernels: final norm and logits) that the pipeline's output
comes back to.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from tvm import relax, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from ..kernels.codegen import fuses_silu_mul
from ..kernels.kv_int8 import row_width
from ..kernels.packing import WeightLayout
from ..kernels.rope import rope_rows_primfunc
from ..tvm_compat import host_target
from .config import LlamaConfig
from .linear import KernelSet, PackedLinear, packed_matmul, packed_parameter
from .norm import RMSNorm
from .parallel import Shard, allreduce, check_tp, gather_last, shard_hint
from .rope import attention_factor, inv_freq, linear_factor
from .separation import ACT_DTYPE, WEIGHTS, Role, attend_cache, attend_remote
from .stages import Stage


def _linear(cfg: LlamaConfig, k: int, n: int, kernels: KernelSet | None,
            interleave: bool = False, shard: Shard | None = None, head: bool = False,
            at: tuple[int, str] | None = None) -> nn.Module:
    """``Y = X @ W.T`` with ``W[n, k]`` (this rank's part of a weight split as ``shard``); the
    ``head`` in the kernel set's head dtype, the Linear ``at`` (layer, name) in its own."""
    if kernels is None:
        linear = nn.Linear(k, n, bias=False, dtype=ACT_DTYPE)
    else:
        dtype = kernels.head_dtype if head else kernels.linear_dtype(*at) if at else None
        linear = PackedLinear(k, n, kernels, interleave, dtype)
    shard_hint(linear.weight, shard)
    return linear


def _project(linear: nn.Module, x: nn.Tensor, residual: nn.Tensor, tp: int) -> nn.Tensor:
    """``linear(x) + residual``: fused into Sandwich's kernel, a separate add in the stock build;
    sharded, the ranks' partial products are summed by the all-reduce, which adds the residual."""
    if tp > 1:
        return allreduce(linear(x), residual)
    if isinstance(linear, PackedLinear):
        return linear(x, residual)
    return linear(x) + residual


def _scaled(x: nn.Tensor, factor: float) -> nn.Tensor:
    """``x * factor`` (Granite's multipliers), nothing where the factor is 1."""
    return x if factor == 1.0 else x * factor


def _row_parallel(tp: int, k: int) -> Shard | None:
    return Shard(1, (k,)) if tp > 1 else None


def _norm(cfg: LlamaConfig, kernels: KernelSet | None, width: int | None = None) -> nn.Module:
    """RMSNorm over the last ``width`` values (default: the hidden states)."""
    width = width or cfg.hidden_size
    if kernels is None:
        return nn.RMSNorm(width, -1, cfg.rms_norm_eps, bias=False, dtype=ACT_DTYPE)
    return RMSNorm(width, cfg.rms_norm_eps, ACT_DTYPE, kernels.isa)


_STDERR_LOCK = threading.Lock()


@contextlib.contextmanager
def native_stderr_off() -> Iterator[None]:
    """Native code's writes to stderr (TVM's C++ log) discarded; Python's errors still raise.
    Process-wide (file descriptor 2), so one at a time, and Python's buffer flushed around it."""
    with _STDERR_LOCK:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 2)
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels: KernelSet | None, kv_dtype: str, tp: int = 1,
                 separated: bool = False, layer: int = 0):
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads // tp,
                                                    cfg.num_key_value_heads // tp, cfg.head_dim)
        self.dtype, self.kv_dtype, self.tp, self.separated = ACT_DTYPE, kv_dtype, tp, separated
        d = self.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        shard = Shard(0, (q, kv, kv)) if tp > 1 else None
        self.qkv_proj = _linear(cfg, cfg.hidden_size, (self.heads + 2 * self.kv_heads) * d, kernels,
                                shard=shard, at=(layer, "qkv"))
        # Qwen2's q, k and v biases: one fused vector, added to the projection (split as its rows)
        self.qkv_bias = (shard_hint(nn.Parameter(((self.heads + 2 * self.kv_heads) * d,), ACT_DTYPE), shard)
                         if cfg.qkv_bias else None)
        # Qwen3's RMSNorm over every q and every k head (one head_dim-wide weight each, on every rank)
        self.q_norm = _norm(cfg, kernels, d) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, kernels, d) if cfg.qk_norm else None
        self.o_proj = _linear(cfg, self.heads * d, cfg.hidden_size, kernels, shard=_row_parallel(tp, q),
                              at=(layer, "o"))
        # Granite's: o_proj's output times residual_multiplier, as its input (exact for any weight type)
        self.residual_scale, self.sm_scale = cfg.residual_multiplier, cfg.attention_scale
        # a model with layers without RoPE (SmolLM3): the others turn q and k here, not in the cache
        self.rope = (rope_rows_primfunc(self.heads, self.kv_heads, d, tuple(float(f) for f in inv_freq(cfg)),
                                        attention_factor(cfg))
                     if cfg.nope_layers and layer not in cfg.nope_layers else None)

    def forward(self, x: nn.Tensor, kv: PagedKVCache, layer_id: int, residual: nn.Tensor) -> nn.Tensor:
        """``residual + o_proj(attention(x))``; separated, attention runs on the attention rank."""
        b, s, _ = x.shape
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv, b, s)
        if self.rope is not None:
            qkv = self._turn(qkv, kv, b, s)
        if self.separated:
            out = attend_remote(qkv, self.heads, self.head_dim)
            return _project(self.o_proj, _scaled(out, self.residual_scale), residual, self.tp)
        qkv = op.reshape(qkv, (b, s, self.heads + 2 * self.kv_heads, self.head_dim))
        out = attend_cache(kv, layer_id, qkv, self.heads, self.kv_dtype, self.sm_scale)
        out = _scaled(op.reshape(out, (b, s, self.heads * self.head_dim)), self.residual_scale)
        return _project(self.o_proj, out, residual, self.tp)

    def _turn(self, qkv: nn.Tensor, kv: PagedKVCache, b, s) -> nn.Tensor:
        """``qkv`` with its q and k heads turned by RoPE to each token's position in its
        sequence (the cache's query positions)."""
        heads, d = self.heads + 2 * self.kv_heads, self.head_dim
        rows = op.reshape(qkv, (b * s, heads, d))
        out = op.tensor_ir_op(self.rope, "rope_rows", args=[rows, kv.get_query_positions(b * s)],
                              out=nn.Tensor.placeholder((b * s, heads, d), ACT_DTYPE))
        return op.reshape(out, (b, s, heads * d))

    def _norm_heads(self, qkv: nn.Tensor, b, s) -> nn.Tensor:
        """``qkv`` with its q heads and its k heads RMS-normalized (Qwen3's, before RoPE). The
        heads are cut by one slice each, which the default schedules cover (a three-way split,
        which nothing fuses, would reach LLVM unscheduled)."""
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        heads = op.reshape(qkv, (b, s, h + 2 * kv, d))

        def cut(lo: int, hi: int, name: str) -> nn.Tensor:
            return op.wrap_nested(relax.op.strided_slice(heads._expr, axes=[2], begin=[lo], end=[hi]), name)

        q, k, v = cut(0, h, "q_heads"), cut(h, h + kv, "k_heads"), cut(h + kv, h + 2 * kv, "v_heads")
        return op.reshape(op.concat([self.q_norm(q), self.k_norm(k), v], dim=2), (b, s, (h + 2 * kv) * d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels: KernelSet | None, tp: int = 1, layer: int = 0):
        full = cfg.intermediate_size
        self.inter, self.tp = full // tp, tp
        # silu·mul is gate_up's fused epilogue on Sandwich's kernels: its weight is interleaved
        self.fused = kernels is not None and fuses_silu_mul(self.inter, kernels.kernel_isa)
        self.gate_up_proj = _linear(cfg, cfg.hidden_size, 2 * self.inter, kernels, interleave=self.fused,
                                    shard=Shard(0, (full, full)) if tp > 1 else None, at=(layer, "gate_up"))
        self.down_proj = _linear(cfg, self.inter, cfg.hidden_size, kernels, shard=_row_parallel(tp, full),
                                 at=(layer, "down"))
        self.residual_scale = cfg.residual_multiplier

    def forward(self, x: nn.Tensor, residual: nn.Tensor) -> nn.Tensor:
        """``residual + down_proj(silu(gate) * up)``; silu·mul fused into gate_up's kernel, or
        a Relax op."""
        proj = self.gate_up_proj
        if self.fused:
            h = proj(x, silu_mul=True)
        else:
            gate, up = op.split(proj(x), 2, axis=-1)
            h = op.silu(gate) * up
        return _project(self.down_proj, _scaled(h, self.residual_scale), residual, self.tp)


class DecoderLayer(nn.Module):
    """Layer ``layer`` of the whole model (its Linears' weight types may differ per layer)."""

    def __init__(self, cfg: LlamaConfig, kernels: KernelSet | None, kv_dtype: str, tp: int = 1,
                 separated: bool = False, layer: int = 0):
        self.self_attn = Attention(cfg, kernels, kv_dtype, tp, separated, layer)
        self.mlp = MLP(cfg, kernels, tp, layer)
        self.input_layernorm = _norm(cfg, kernels)
        self.post_attention_layernorm = _norm(cfg, kernels)

    def forward(self, x: nn.Tensor, kv: PagedKVCache, layer_id: int) -> nn.Tensor:
        x = self.self_attn(self.input_layernorm(x), kv, layer_id, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class Embedding(nn.Module):
    """Token embeddings; with a ``layout`` they are read from a packed weight (the tied lm_head's,
    or a table of the head's type), widened to fp32."""

    def __init__(self, cfg: LlamaConfig, layout: WeightLayout | None):
        self.hidden = cfg.hidden_size
        self.layout = layout
        self.weight = (packed_parameter(cfg.vocab_size, cfg.hidden_size, layout) if layout
                       else nn.Parameter((cfg.vocab_size, cfg.hidden_size), ACT_DTYPE))

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        flat = op.reshape(ids, (-1,))
        if self.layout is None:
            rows = op.take(self.weight, flat, axis=0)
        else:
            layout = self.layout

            def gather(w: te.Tensor, t: te.Tensor) -> te.Tensor:
                return te.compute((t.shape[0], self.hidden), lambda i, j: layout.element(w, t[i], j),
                                  name="embed_packed")

            rows = op.tensor_expr_op(gather, "embed_packed", [self.weight, flat])
        return op.reshape(rows, (*ids.shape, self.hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels: KernelSet | None, kv_dtype: str, tp: int = 1,
                 stage: Stage | None = None, separated: bool = False):
        # tied and unsharded: the embedding is read from the packed lm_head (one copy); otherwise
        # a table of its own, packed in the head's type unless that is fp32 (a quarter of the
        # bytes under q8_0, as llama.cpp keeps token_embd quantized)
        tied = cfg.tie_word_embeddings and tp == 1
        packed = kernels is not None and (tied or kernels.head_dtype != "float32")
        if stage is None or stage.first:
            self.embed_tokens = Embedding(cfg, kernels.layout(dtype=kernels.head_dtype) if packed else None)
        count = cfg.num_hidden_layers if stage is None else stage.layers
        first = 0 if stage is None else stage.first_layer
        self.layers = nn.ModuleList([DecoderLayer(cfg, kernels, kv_dtype, tp, separated, first + i)
                                     for i in range(count)])
        if stage is None or stage.first:  # a pipeline's head is on its first stage
            self.norm = _norm(cfg, kernels)
        self.embeds, self.norms = stage is None or stage.first, stage is None
        self.embed_scale = cfg.embedding_multiplier

    def forward(self, x: nn.Tensor, kv: PagedKVCache) -> nn.Tensor:
        """Token ids (the first stage) or hidden states in; hidden states out (normed by the
        whole model; a pipeline's head norms them)."""
        if self.embeds:
            x = _scaled(self.embed_tokens(x), self.embed_scale)
        for i, layer in enumerate(self.layers):  # the cache's layers are the stage's own
            x = layer(x, kv, i)
        return self.norm(x) if self.norms else x


class LlamaForCausalLM(nn.Module):
    """The served model. ``kernels=None`` builds TVM's stock version (``nn.Linear``).
    ``kv_dtype``: what the paged KV cache stores (float32, or 16 bits as llama.cpp's default).
    ``tp``: the processes a Megatron-sharded model runs on (this is one rank's part).
    ``stage``: the pipeline stage this module runs (None: the whole model). ``role``: the weight
    side of a separated model (``separation``; its attention runs on the attention rank)."""

    def __init__(self, cfg: LlamaConfig, kernels: KernelSet | None = None, kv_dtype: str = "float32",
                 tp: int = 1, stage: Stage | None = None, role: Role | None = None):
        check_tp(cfg, tp)
        if role is not None and role.name != WEIGHTS:
            raise ValueError(f"LlamaForCausalLM runs the weight side of a separated model, not {role.name!r}")
        self.separated = role is not None
        self.cfg = cfg
        self.kernels = kernels
        self.kv_dtype = kv_dtype
        self.tp = tp
        self.stage = None if stage is None or stage.count == 1 else stage
        self.model = LlamaModel(cfg, kernels, kv_dtype, tp, self.stage, self.separated)
        # sharded: a vocabulary-split head of its own; staged: on the first stage, with the embedding
        self.tied = cfg.tie_word_embeddings and tp == 1 and (self.stage is None or self.stage.first)
        self.heads = self.stage is None or self.stage.first  # holds the head's weights
        self.gives_logits = self.stage is None  # a pipeline's last stage gives hidden states
        if not self.tied and self.heads:
            vocab = Shard(0, (cfg.vocab_size,)) if tp > 1 else None
            rows = vocab.local(tp) if vocab else cfg.vocab_size
            self.lm_head = _linear(cfg, cfg.hidden_size, rows, kernels, shard=vocab, head=True)

    def _logits(self, h: nn.Tensor) -> nn.Tensor:
        """The head's logits (divided by Granite's ``logits_scaling``)."""
        return _scaled(self._head(h), 1.0 / self.cfg.logits_scaling)

    def _head(self, h: nn.Tensor) -> nn.Tensor:
        if self.tp > 1:
            return gather_last(self.lm_head(h), self.cfg.vocab_size)
        if not self.tied:
            return self.lm_head(h)
        w = self.model.embed_tokens.weight
        if self.kernels is None:
            return op.matmul(h, op.permute_dims(w))
        return packed_matmul(h, w, self.cfg.vocab_size, self.kernels,  # the tied weight, packed
                             dtype=self.kernels.head_dtype)

    def _forward(self, ids: nn.Tensor, kv: PagedKVCache, positions: nn.Tensor | None) -> nn.Tensor:
        h = self.model(ids, kv)
        if self.stage is not None and not self.stage.last:  # every token's hidden state goes on
            return h
        if positions is None:  # prefill: the last token only

            def last(x: te.Tensor) -> te.Tensor:
                b, s, d = x.shape
                return te.compute((b, 1, d), lambda i, _, j: x[i, s - 1, j], name="last_token")

            h = op.tensor_expr_op(last, "last_token", [h])
        else:
            h = op.take(h, positions, axis=1)
        return self._logits(h) if self.gives_logits else h  # a pipeline's: to the first stage's head

    def prefill(self, input_ids: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_ids, paged_kv_cache, None), paged_kv_cache

    def decode(self, input_ids: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._decode(input_ids, paged_kv_cache)

    def _decode(self, ids: nn.Tensor, kv: PagedKVCache):
        h = self.model(ids, kv)
        return (self._logits(h) if self.gives_logits else h), kv

    def head(self, hidden: nn.Tensor):
        """A pipeline's head (its first stage): the last stage's hidden states to logits."""
        return self._logits(self.model.norm(hidden))

    def decode_head(self, hidden: nn.Tensor):
        """``head`` on the decode kernels (the decode plan's cores, m = batch)."""
        return self.head(hidden)

    def batch_prefill(self, input_ids: nn.Tensor, logit_positions: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_ids, paged_kv_cache, logit_positions), paged_kv_cache

    def batch_decode(self, input_ids: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._decode(input_ids, paged_kv_cache)

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        cfg = self.cfg
        # separated: the attention rank holds the real cache; this one keeps the same pages and
        # sequences (the engine's bookkeeping) over one layer it never reads
        layers = 1 if self.separated else cfg.num_hidden_layers if self.stage is None else self.stage.layers
        # an int8 cache: TVM's own kernels for it warn of int8 stores as they are built; the ones
        # this model calls are replaced (compiler.kv_cache), the tree-mask ones never called
        with native_stderr_off() if self.kv_dtype == "int8" else contextlib.nullcontext():
            return paged_kv_cache(cfg, layers, self.kv_dtype, self.tp, max_batch_size, max_total_seq_len,
                                  prefill_chunk_size, page_size, support_sliding_window)

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        return model_spec(self, token_inputs=self.stage is None or self.stage.first,
                          head=self.stage is not None and self.stage.first)


def _tvm_rope_scaling(cfg: LlamaConfig) -> bool:
    return bool(cfg.rope_scaling) and cfg.rope_scaling.get("rope_type") == "llama3"


def paged_kv_cache(cfg: LlamaConfig, layers: int, kv_dtype: str, tp: int, max_batch_size: tirx.Var,
                   max_total_seq_len: tirx.Var, prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                   support_sliding_window: tirx.Var) -> PagedKVCache:
    """TVM's paged KV cache for ``layers`` layers of one of ``tp`` ranks' heads, storing ``kv_dtype``."""
    return TIRPagedKVCache(
        attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size, page_size=page_size,
        support_sliding_window=support_sliding_window,
        layer_partition=relax.ShapeExpr([0, layers]),
        num_hidden_layers=layers, num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=cfg.num_key_value_heads // tp,
        qk_head_dim=row_width(cfg.head_dim, kv_dtype),
        v_head_dim=row_width(cfg.head_dim, kv_dtype), mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        # a model with layers without RoPE turns q and k in its graph (``Attention.rope``)
        rope_mode=RopeMode.NONE if cfg.nope_layers else RopeMode.NORMAL,
        rope_scale=1 if linear_factor(cfg) == 1 else 1.0 / linear_factor(cfg),
        rope_theta=cfg.rope_theta,
        # TVM's own RoPE (the stock build's) takes Llama-3's scaling; linear is rope_scale; YaRN and
        # LongRoPE have none of its (compile_model refuses them), Sandwich's fused_rope replaces it
        rope_scaling=dict(cfg.rope_scaling) if _tvm_rope_scaling(cfg) else {},
        rope_ext_factors=relax.prim_value(0),
        rotary_dim=cfg.rope_dims, enable_disaggregation=False, dtype=kv_dtype,
        target=host_target(),
    )


def model_spec(module: nn.Module, *, token_inputs: bool, head: bool) -> nn.spec.ModuleSpec:
    """The exported functions: ``token_inputs`` (token ids in, else the previous pipeline
    stage's hidden states), ``head``: a pipeline's head functions too."""
    hidden = module.cfg.hidden_size
    packed = {"param_mode": "packed", "effect_mode": "none"}
    kv = nn.spec.Object(object_type=PagedKVCache)
    if token_inputs:

        def inputs(*shape):
            return nn.spec.Tensor(list(shape), "int32")
    else:

        def inputs(*shape):
            return nn.spec.Tensor([*shape, hidden], ACT_DTYPE)
    spec = {
        "prefill": {"input_ids": inputs(1, "seq_len"), "paged_kv_cache": kv, "$": packed},
        "decode": {"input_ids": inputs(1, 1), "paged_kv_cache": kv, "$": packed},
        "batch_prefill": {"input_ids": inputs(1, "seq_len"),
                          "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                          "paged_kv_cache": kv, "$": packed},
        "batch_decode": {"input_ids": inputs("batch_size", 1), "paged_kv_cache": kv, "$": packed},
        "create_paged_kv_cache": {
            "max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int,
            "page_size": int, "support_sliding_window": int,
            "$": {"param_mode": "none", "effect_mode": "none"},
        },
    }
    if head:  # the pipeline's head (its first stage): hidden states in
        spec["head"] = {"hidden": nn.spec.Tensor([1, "rows", hidden], ACT_DTYPE), "$": packed}
        spec["decode_head"] = {"hidden": nn.spec.Tensor(["batch_size", 1, hidden], ACT_DTYPE), "$": packed}
    return nn.spec.ModuleSpec.from_raw(spec, module)
