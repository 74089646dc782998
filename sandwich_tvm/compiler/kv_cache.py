"""Relax pass: swap the paged KV cache's attention and RoPE kernels for Sandwich's.

TVM's ``PagedKVCache`` compiles its own CPU kernels (serial scalar loop nests); ours keep their
names and signatures (``kernels.attention``, ``kernels.attention_amx``, ``kernels.rope``), so
the cache's runtime calls them unchanged. An int8 cache (``kernels.kv_int8``) also swaps the
merge of a prompt's new keys with its cached prefix, which must read and write int8 rows. TVM
still builds its sliding-window and tree-mask kernels for such a cache, which would read the
rows' bytes as numbers; the engine never calls them (no token trees, and the cache is made
without TVM's sliding window, which evicts pages: a model's window is applied by our kernels,
by position, over pages that are all kept).
"""

from __future__ import annotations

from ..kernels.attention import decode_paged_primfunc, prefill_paged_primfunc, prefill_ragged_primfunc
from ..kernels.attention_amx import prefill_paged_amx_primfunc, prefill_ragged_amx_primfunc, supports
from ..kernels.kv_int8 import merge_state_primfunc
from ..kernels.rope import rope_primfunc
from ..model.config import LlamaConfig
from ..model.rope import attention_factor, inv_freq
from ..tvm_compat import tvm


def replace_cache_kernels(mod: tvm.IRModule, cfg: LlamaConfig, decode_threads: int = 4,
                          isa: str | None = None, page_size: int = 16,
                          kv_dtype: str = "float32", tp: int = 1, amx: bool = False) -> tvm.IRModule:
    """Swap the KV cache's attention kernels and its RoPE for ours (same names and signatures,
    so the cache's runtime calls them unchanged), for one of ``tp`` ranks' heads. Decode splits
    each sequence's pages into two chunks per decode thread. ``amx`` (a bf16 model whose GEMMs
    run on AMX): prompt attention (new keys and paged prefix) on AMX tiles too, in bf16 like the
    Linears' inputs (not on an int8 cache, nor with a sliding window, which only the vector
    kernels apply)."""
    h_kv, h_q, d = cfg.num_key_value_heads // tp, cfg.num_attention_heads // tp, cfg.head_dim
    window = cfg.sliding_window or 0
    if amx and supports(d) and kv_dtype != "int8" and not window:
        ragged = prefill_ragged_amx_primfunc(h_kv, h_q, d, kv_dtype)
        paged = prefill_paged_amx_primfunc(h_kv, h_q, d, page_size, kv_dtype)
    else:
        ragged = prefill_ragged_primfunc(h_kv, h_q, d, kv_dtype, isa, window)
        paged = prefill_paged_primfunc(h_kv, h_q, d, page_size, isa, kv_dtype, window)
    ours = {"batch_prefill_ragged_kv": ragged, "batch_prefill_paged_kv_cpu": paged,
            "batch_decode_paged_kv_cpu": decode_paged_primfunc(h_kv, h_q, d, split=2 * decode_threads,
                                                               isa=isa, dtype=kv_dtype, window=window),
            "fused_rope": rope_primfunc(h_q, h_kv, d, tuple(float(x) for x in inv_freq(cfg)), kv_dtype,
                                        attention_factor(cfg))}
    if kv_dtype == "int8":
        ours["merge_state_inplace_cpu"] = merge_state_primfunc(d)
    for gv, func in list(mod.functions_items()):
        if gv.name_hint in ours and isinstance(func, tvm.tirx.PrimFunc):
            new = ours[gv.name_hint]
            if len(new.params) != len(func.params):
                raise RuntimeError(f"TVM's {gv.name_hint} signature changed; update sandwich_tvm/kernels")
            mod[gv] = new
            del ours[gv.name_hint]
    if ours:
        raise RuntimeError(f"TVM's KV cache no longer has {', '.join(ours)}; update sandwich_tvm/kernels")
    return mod
