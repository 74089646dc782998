"""Linear layers on prepacked weights that call Sandwich's generated kernels.

A Linear calls its GEMM's prefill kernel; the compiler's ``SelectPhaseKernels`` pass swaps in
the decode kernel inside the decode functions, so both phases share one prepacked weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..host import CpuSignature, cpu_flags, host_isa, host_signature
from ..kernels.codegen import Bucket, linear_primfunc
from ..kernels.database import find_record
from ..kernels.defaults import default_buckets
from ..kernels.microkernel import ISAS, kernel_isa
from ..kernels.packing import WeightLayout
from ..kernels.quant import head_dtype
from ..kernels.schedule import GemmShape
from ..tvm_compat import tvm


@dataclass
class KernelSet:
    """Which generated kernel each (phase, n, k) Linear calls.

    A shape tuned for the phase's thread count (a record, ``kernels.database``) uses its buckets up to the
    largest tuned m and the default schedules above it; an untuned shape gets the defaults.
    Decode kernels keep only the buckets for m <= max_batch. Records are those of ``cpu``
    (default: this host), and only when its ISA is the one the kernels are built for.
    ``dtype`` is the weights' precision (activations and accumulation stay fp32); bf16
    weights run on the CPU's bf16 dot-product unit where it has one (``kernel_isa``).
    """

    prefill_threads: int
    decode_threads: int
    max_batch: int = 8
    root: Path | None = None
    isa: str = field(default_factory=host_isa)
    cpu: CpuSignature | None = None
    dtype: str = "float32"
    int8_activations: bool = True  # quantized weights: on the CPU's int8 dot-product unit where it has one
    # (layer, Linear) -> a wider weight type than ``dtype``, as a GGUF holds it (``RunSpec.wider_linears``)
    wider: dict[tuple[int, str], str] = field(default_factory=dict)
    sources: dict[tuple[str, str], str] = field(default_factory=dict)
    # kernel name -> (shape, phase, epilogue), for the pass that picks the decode kernels
    calls: dict[str, tuple[GemmShape, str, str]] = field(default_factory=dict)
    _funcs: dict[tuple[str, GemmShape, str, int | None], tvm.tirx.PrimFunc] = field(default_factory=dict)

    @property
    def kernel_isa(self) -> str:
        """The micro-kernels' ISA: ``isa``, or its bf16 extension where ``cpu`` (this host by
        default, when ``isa`` is its ISA) has it."""
        return self.kernel_isa_for(self.dtype)

    @property
    def head_dtype(self) -> str:
        """The lm_head's weight type (``kernels.quant.head_dtype``: q8_0 under 4-bit weights)."""
        return head_dtype(self.dtype)

    def linear_dtype(self, layer: int, linear: str) -> str:
        """The weight type of ``linear`` (qkv, o, gate_up, down) in layer ``layer``."""
        return self.wider.get((layer, linear), self.dtype)

    def kernel_isa_for(self, dtype: str) -> str:
        if self.cpu is not None:
            flags = frozenset(self.cpu.features or ())
        else:
            flags = cpu_flags() if self.isa == host_isa() else frozenset()
        return kernel_isa(self.isa, dtype, flags, self.int8_activations)

    def layout(self, interleave: bool = False, dtype: str | None = None) -> WeightLayout:
        """How a Linear weight of this kernel set (of ``dtype``: default the set's) is packed."""
        dtype = dtype or self.dtype
        return WeightLayout(self.kernel_isa_for(dtype), dtype, interleave)

    def threads(self, phase_name: str) -> int:
        return self.prefill_threads if phase_name == "prefill" else self.decode_threads

    def buckets(self, shape: GemmShape, phase_name: str, epilogue: str = "none") -> list[Bucket]:
        """The schedules of ``shape`` in ``phase_name``, m range by m range: its record tuned
        with ``epilogue``, then the plain GEMM's record where that was tuned to larger m, then
        the default schedules beyond every record."""
        threads = self.threads(phase_name)
        max_m = self.max_batch if phase_name == "decode" else None
        cpu = self.cpu or host_signature()
        records = []
        if cpu.isa == self.isa:
            own = self.kernel_isa_for(shape.dtype)  # a record of the other activation mode: another layout
            readable = {own, *ISAS[own].extends}
            for candidate in dict.fromkeys((GemmShape(shape.n, shape.k, shape.dtype, epilogue), shape.plain)):
                rec = find_record(candidate, threads, self.root, cpu)
                if (rec is not None and rec.shape == candidate
                        and all(b.schedule.mk.isa in readable for b in rec.buckets())):
                    records.append(rec)
        self.sources[(phase_name, shape.name)] = "tuned" if records else "default"
        out: list[Bucket] = []
        covered = 0  # every m <= covered has a bucket
        for rec in records:
            tuned_to = max(t.m for t in rec.tuned)
            for b in rec.buckets():
                if max_m is not None and covered >= max_m:
                    break
                m_max = min(b.m_max, tuned_to)
                if m_max > covered:
                    out.append(Bucket(m_max, b.schedule))
                    covered = m_max
        if max_m is None or max_m > covered:  # beyond the tuned range: the default schedules
            out += [b for b in default_buckets(shape, threads, max_m, self.kernel_isa_for(shape.dtype))
                    if b.m_max > covered]
        out[-1] = Bucket(1 << 62, out[-1].schedule)
        return out

    def primfunc(self, shape: GemmShape, phase_name: str, epilogue: str = "none", m: int | None = None
                 ) -> tuple[str, tvm.tirx.PrimFunc]:
        """The kernel for ``shape`` in ``phase_name``: every bucket of its schedule (any m), or,
        for a call whose ``m`` is known when compiling, only the bucket that serves that m (a
        kernel of one variant streams cold weights faster: in one function with the other
        variants LLVM compiled the same loop nest into a slower one, 351 vs 154 us a call for a
        1-thread 3072x768 bf16 GEMV on Zen 4, ``scripts/decode_profile.py``)."""
        suffix = ("" if epilogue == "none" else f"_{epilogue}") + ("" if m is None else f"_m{m}")
        name = f"sandwich_linear_{shape.name}_{phase_name}{suffix}"
        key = (phase_name, shape, epilogue, m)
        if key not in self._funcs:
            buckets = self.buckets(shape, phase_name, epilogue)
            if m is not None:
                buckets = [Bucket(1 << 62, next(b.schedule for b in buckets if b.m_max >= m))]
            self._funcs[key] = linear_primfunc(shape, buckets, name, epilogue)
            self.calls[name] = (shape, phase_name, epilogue)
        return name, self._funcs[key]


def packed_parameter(n: int, k: int, layout: WeightLayout) -> nn.Parameter:
    """The parameter holding ``W[n, k]`` packed as ``layout``, which rides on it (``attrs``,
    as MLC-LLM's shard hints do) to the artifact and the weight loader."""
    param = nn.Parameter(layout.shape(n, k), layout.storage)
    param.attrs["layout"] = layout
    return param


class PackedLinear(nn.Module):
    """``y = x @ W.T (+ residual)`` without bias; ``W[n, k]`` is stored prepacked
    (``WeightLayout``). The residual add is fused into the kernel's store; ``silu_mul`` (an
    ``interleave``d gate_up weight, see ``kernels.codegen``) returns ``silu(gate) * up``."""

    def __init__(self, in_features: int, out_features: int, kernels: KernelSet, interleave: bool = False,
                 dtype: str | None = None):
        self.in_features, self.out_features = in_features, out_features
        self.kernels, self.dtype = kernels, dtype or kernels.dtype
        self.weight = packed_parameter(out_features, in_features, kernels.layout(interleave, self.dtype))

    def forward(self, x: nn.Tensor, residual: nn.Tensor | None = None, silu_mul: bool = False) -> nn.Tensor:
        return packed_matmul(x, self.weight, self.out_features, self.kernels, residual, silu_mul, self.dtype)


def packed_matmul(x: nn.Tensor, weight: nn.Tensor, n: int, kernels: KernelSet,
                  residual: nn.Tensor | None = None, silu_mul: bool = False, dtype: str | None = None
                  ) -> nn.Tensor:
    """``x[..., k] @ W.T (+ residual[..., n])`` through the prefill kernel for (n, k) (the decode
    functions get the decode kernel from ``compiler.phases``); ``weight`` is packed. With
    ``silu_mul`` the result is ``silu(gate) * up``, ``[..., n / 2]``."""
    k = int(x.shape[-1])
    lead = list(x.shape[:-1])

    def rows(t: nn.Tensor, width: int) -> nn.Tensor:
        return op.reshape(t, (-1, width)) if len(lead) != 1 else t

    x2 = rows(x, k)
    args = [x2, weight] + ([] if residual is None else [rows(residual, n)])
    epilogue = "silu_mul" if silu_mul else "none" if residual is None else "residual"
    name, func = kernels.primfunc(GemmShape(n, k, dtype or kernels.dtype), "prefill", epilogue)
    n_out = n // 2 if silu_mul else n
    y = op.tensor_ir_op(func, name, args=args, out=nn.Tensor.placeholder((x2.shape[0], n_out), x.dtype))
    return op.reshape(y, (*lead, n_out)) if len(lead) != 1 else y
