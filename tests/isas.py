"""The ISAs tests cover: every ISA's code is built; it runs only where this CPU can run it."""

from __future__ import annotations

import pytest

from sandwich_tvm.host import can_run, host_isa
from sandwich_tvm.kernels.microkernel import ISAS
from sandwich_tvm.kernels.quant import QTYPES

ALL_ISAS = sorted(isa for isa, spec in ISAS.items() if "float32" in spec.dtypes)  # vector ISAs
every_isa = pytest.mark.parametrize("isa", ALL_ISAS)
# Every (micro-kernel ISA, weight dtype) with 16-bit weights: widened on the vector ISAs, bf16
# pairs on avx512bf16 and neonbf16, bf16 tiles on amx.
HALF_CASES = [(isa, dt) for isa, spec in sorted(ISAS.items()) for dt in spec.dtypes
              if dt in ("bfloat16", "float16")]
# Every (vector ISA, block-quantized weight type): dequantized in registers.
QUANT_CASES = [(isa, dt) for isa, spec in sorted(ISAS.items()) for dt in spec.dtypes if dt in QTYPES]

# The m a kernel's tails are checked at, from 1 to 300: every m up to 48 and from 76 to 110 (every
# remainder of the tests' row tiles and blocks, MR <= 8 and MC <= 16 split over pm = 2 threads,
# below and above the last bucket's edge at 80), then larger m.
TAIL_MS = [*range(1, 49), *range(76, 111), 127, 128, 200, 255, 256, 299, 300]

# What a vector register looks like in each ISA's assembly.
VECTOR_REGISTER = {"avx2": "%ymm", "avx512": "%zmm", "avx512bf16": "%zmm", "avx512vnni": "%zmm",
                   "avxvnni": "%ymm", "avx2dot": "%ymm", "avx512dot": "%zmm", "neon": ".4s",
                   "neonbf16": ".4s", "neondot": ".4s", "amx": "%tmm",
                   "amxint8": "%tmm", "amxdq": "%tmm"}
# The int8 dot-product instruction of each int8 ISA, as its assembly spells it.
DOT_INSTRUCTION = {"avx512vnni": "vpdpbusd", "avxvnni": "{vex}\tvpdpbusd", "avx2dot": "vpmaddubsw",
                   "avx512dot": "vpmaddubsw", "neondot": "sdot",
                   "amxint8": "tdpbsud", "amxdq": "tdpbf16ps"}


def require_runnable(isa: str) -> None:
    """Skip the *execution* of code this CPU cannot run, saying why."""
    if not can_run(isa):
        pytest.skip(f"this CPU ({host_isa()}) cannot execute {isa} code; it is built, not run")


def assembly(executable) -> str:
    mod = executable.mod if hasattr(executable, "mod") else executable
    for m in [mod, *mod.imports]:
        if getattr(m, "kind", "") == "llvm" or m.type_key == "llvm":
            return m.inspect_source("asm")
    return mod.inspect_source("asm")
