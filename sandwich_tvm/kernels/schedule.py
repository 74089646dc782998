"""A GEMM schedule as a value: micro-kernel + computation slice + polymerization scheme."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .microkernel import MicroKernel


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, order=True)
class Slice:
    """A computation slice: MC rows x NC columns x KC reductions, micro-kernel repeats."""

    mc: int
    nc: int
    kc: int


@dataclass(frozen=True, order=True)
class Polymerization:
    """How the thread grid splits the GEMM: pm x pn x pk threads (pk > 1 is split-K)."""

    pm: int
    pn: int
    pk: int = 1

    @property
    def threads(self) -> int:
        return self.pm * self.pn * self.pk

    def __str__(self) -> str:
        return f"{self.pm}x{self.pn}x{self.pk}"


def polymerizations(threads: int) -> tuple[Polymerization, ...]:
    """Every factorization of the thread count into (pm, pn, pk)."""
    out = []
    for pm in range(1, threads + 1):
        if threads % pm:
            continue
        rest = threads // pm
        for pn in range(1, rest + 1):
            if rest % pn == 0:
                out.append(Polymerization(pm, pn, rest // pn))
    return tuple(out)


@dataclass(frozen=True, order=True)
class GemmSchedule:
    """Everything the TensorIR generator needs besides the shape."""

    mk: MicroKernel
    slice: Slice
    poly: Polymerization

    @property
    def key(self) -> str:
        s, p = self.slice, self.poly
        return f"{self.mk.name}/mc{s.mc}_nc{s.nc}_kc{s.kc}/p{p}"

    def to_json(self) -> dict:
        s, p = self.slice, self.poly
        return {
            "mk": self.mk.to_json(),
            "slice": [s.mc, s.nc, s.kc],
            "poly": [p.pm, p.pn, p.pk],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json(cls, d: dict) -> GemmSchedule:
        return cls(MicroKernel.from_json(d["mk"]), Slice(*d["slice"]), Polymerization(*d["poly"]))

    @classmethod
    def loads(cls, text: str) -> GemmSchedule:
        return cls.from_json(json.loads(text))


# What a kernel fuses into the store of its register tile (``codegen``): nothing, the
# decoder's skip connection, a bias, or the MLP's silu(gate) * up.
EPILOGUES = ("none", "residual", "bias", "silu_mul")


@dataclass(frozen=True)
class GemmShape:
    """``Y[m, n] = X[m, k] @ W[n, k].T`` with m known only at run time, and the epilogue the
    kernel fuses. A fused epilogue changes which schedule is fastest (its loads and stores share
    the tile's memory traffic), so records are tuned and kept per epilogue."""

    n: int
    k: int
    dtype: str = "float32"
    epilogue: str = "none"

    def __post_init__(self) -> None:
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {self.epilogue!r}; one of {EPILOGUES}")

    @property
    def name(self) -> str:
        fused = "" if self.epilogue == "none" else f"_{self.epilogue}"
        return f"n{self.n}_k{self.k}_{self.dtype}{fused}"

    @property
    def plain(self) -> GemmShape:
        """The same GEMM without an epilogue."""
        return GemmShape(self.n, self.k, self.dtype)

    def flops(self, m: int) -> int:
        return 2 * m * self.n * self.k
