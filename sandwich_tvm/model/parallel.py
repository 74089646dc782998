"""Tensor parallelism in the model file: shard hints on parameters and the collectives the
sharded model calls.

As in MLC-LLM's ``llama_model.py`` a parameter says how it is split (``attrs["shard"]``, a
``Shard``), the artifact records it and the loader cuts each rank's part from the checkpoint.
Megatron's partition: qkv and gate_up by output rows (whole heads, whole KV heads), o_proj and
down_proj by input columns followed by an all-reduce, lm_head by vocabulary followed by a
gather. The collectives are packed functions every worker registers
(``runtime.tp_worker``), called from Relax with ``R.call_dps_packed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..kernels.quant import BLOCK, QuantBlocks
from .config import LlamaConfig

ALLREDUCE = "sandwich.tp_allreduce"  # (x, out): out = sum of x over the ranks
ALLREDUCE_ADD = "sandwich.tp_allreduce_add"  # (x, residual, out): out = residual + sum of x
GATHER = "sandwich.tp_gather_last"  # (x, out): rank r's x fills out[..., r * w : (r + 1) * w]


class ShardError(ValueError):
    """A model that cannot be split over the asked number of processes."""


def check_tp(cfg: LlamaConfig, tp: int) -> None:
    """Raise ``ShardError`` unless every rank gets whole heads, whole KV heads and an equal
    share of the MLP (the constraints TopoTree's plans already respect)."""
    if tp < 1:
        raise ShardError(f"tensor parallelism must be 1 or more processes, not {tp}")
    if cfg.tp_degrees_ok(tp):
        return
    for what, count in (("attention heads", cfg.num_attention_heads),
                        ("KV heads", cfg.num_key_value_heads),
                        ("MLP columns (intermediate_size)", cfg.intermediate_size)):
        if count % tp:
            raise ShardError(f"{cfg.name} has {count} {what}, which {tp} processes cannot share evenly; "
                             f"use a plan whose process count divides {count}")


@dataclass(frozen=True)
class Shard:
    """How a ``W[n, k]`` checkpoint tensor is split: along ``dim`` (0: output rows, 1: input
    columns), segment by segment (a fused q|k|v or gate|up is split per segment, so each rank
    holds its own heads of each). A segment that ``tp`` does not divide is padded with zeros
    up to ``ceil(size / tp)`` per rank (the vocabulary)."""

    dim: int
    segments: tuple[int, ...]

    def local(self, tp: int) -> int:
        """The size of one rank's part along ``dim``."""
        return sum(-(-s // tp) for s in self.segments)

    def take(self, w: np.ndarray, rank: int, tp: int) -> np.ndarray:
        """Rank ``rank``'s part of the full tensor ``w``."""
        if w.shape[self.dim] != sum(self.segments):
            raise ShardError(f"a tensor of shape {list(w.shape)} does not split into segments "
                             f"{list(self.segments)} along dim {self.dim}")
        parts, start = [], 0
        for size in self.segments:
            step = -(-size // tp)
            lo, hi = min(rank * step, size), min((rank + 1) * step, size)
            index = [slice(None)] * w.ndim
            index[self.dim] = slice(start + lo, start + hi)
            part = w[tuple(index)]
            if hi - lo < step:  # the last rank's share of a segment tp does not divide
                pad = [(0, 0)] * w.ndim
                pad[self.dim] = (0, step - (hi - lo))
                part = np.pad(part, pad)
            parts.append(part)
            start += size
        return np.concatenate(parts, axis=self.dim) if len(parts) > 1 else np.ascontiguousarray(parts[0])

    def take_blocks(self, w: QuantBlocks, rank: int, tp: int) -> QuantBlocks | None:
        """Rank ``rank``'s part of GGUF blocks, still blocks (their values as the file holds
        them, never re-rounded): rows whole, or k where every rank's cut falls between blocks;
        None where a cut would split a block (the caller then dequantizes)."""
        if w.shape[self.dim] != sum(self.segments):
            raise ShardError(f"a tensor of shape {list(w.shape)} does not split into segments "
                             f"{list(self.segments)} along dim {self.dim}")
        values = (lambda: self.take(np.asarray(w, np.float32), rank, tp)) if w.exact else None
        n = w.shape[0]
        if self.dim == 0:  # short shares: zero blocks; read (regrouped) only when packed as blocks
            return QuantBlocks.later(lambda: self.take(w.raw, rank, tp), self.local(tp), w.qtype, w.k, values)
        if any(size % BLOCK or -(-size // tp) % BLOCK for size in self.segments):
            return None
        blocks = Shard(1, tuple(size // BLOCK for size in self.segments))

        def part() -> np.ndarray:
            return blocks.take(w.raw.reshape(n, w.k // BLOCK, w.qtype.block_bytes), rank, tp).reshape(n, -1)

        return QuantBlocks.later(part, n, w.qtype, blocks.local(tp) * BLOCK, values)

    def to_json(self) -> dict:
        return {"dim": self.dim, "segments": list(self.segments)}

    @classmethod
    def from_json(cls, d: dict) -> Shard:
        return cls(int(d["dim"]), tuple(int(s) for s in d["segments"]))


def shard_hint(param: nn.Parameter, shard: Shard | None) -> nn.Parameter:
    """Attach ``shard`` to ``param`` (nothing for an unsharded model)."""
    if shard is not None:
        param.attrs["shard"] = shard
    return param


def allreduce(x: nn.Tensor, residual: nn.Tensor | None = None) -> nn.Tensor:
    """The sum of ``x`` over the ranks (the row-parallel Linear's partial products), plus
    ``residual`` when given: the residual add is fused into the collective's reduction."""
    out = nn.Tensor.placeholder(x.shape, x.dtype)
    if residual is None:
        return op.extern(ALLREDUCE, [x], out=out)
    return op.extern(ALLREDUCE_ADD, [x, residual], out=out)


def gather_last(x: nn.Tensor, full: int) -> nn.Tensor:
    """Every rank's ``x[..., w]`` side by side, cut to ``full`` columns (the vocabulary)."""
    return op.extern(GATHER, [x], out=nn.Tensor.placeholder((*x.shape[:-1], full), x.dtype))
