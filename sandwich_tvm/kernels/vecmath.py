"""Vectorizable math as TVMScript expression text, for generated kernels.

LLVM turns ``T.exp`` on a vector into one scalar libm call per lane; these polynomials stay
in vector registers. Arguments are repeated in the result (let-bindings inside vectorized
loops do not survive TVM 0.27's vectorizer), so pass buffer loads or cheap expressions.
"""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)
_EXP2_TAYLOR = [math.log(2) ** i / math.factorial(i) for i in range(7)]


def exp2(x: str) -> str:
    """2**x for x in [-126, 0]: x = n + f with |f| <= 1/2, a degree-6 polynomial for 2**f
    (|error| < 2e-7 relative), 2**n built in the exponent bits."""
    f = f"({x} - T.round({x}))"
    poly = f"T.float32({_EXP2_TAYLOR[-1]!r})"
    for c in reversed(_EXP2_TAYLOR[:-1]):
        poly = f"({poly} * {f} + T.float32({c!r}))"
    scale = f'T.reinterpret("float32", T.shift_left(T.Cast("int32", T.round({x})) + 127, 23))'
    return f"{poly} * {scale}"


def silu_mul(gate: str, up: str) -> str:
    """``silu(gate) * up`` = gate * sigmoid(gate) * up, with e = exp(-|gate|) in (0, 1]:
    sigmoid is 1 / (1 + e) for gate >= 0 and e / (1 + e) below, so nothing overflows."""
    g = f"({gate})"
    e = exp2(f"T.max(T.fabs({g}) * T.float32({-LOG2E!r}), T.float32(-126))")
    sig = f"(T.if_then_else({g} >= T.float32(0), T.float32(1), {e}) / (T.float32(1) + {e}))"
    return f"{g} * {sig} * ({up})"


def load_f32(expr: str, dtype: str) -> str:
    """A ``dtype`` element read as fp32 (16-bit storage, fp32 arithmetic)."""
    return expr if dtype == "float32" else f'T.Cast("float32", {expr})'


def store_as(expr: str, dtype: str) -> str:
    """An fp32 value written as ``dtype``."""
    return expr if dtype == "float32" else f'T.Cast("{dtype}", {expr})'


def _round_bf16(bits: str) -> str:
    """fp32 bits (a uint32) rounded to nearest even at bit 16: the bf16 is the high half."""
    return f"({bits} + T.uint32(32767) + (({bits} >> T.uint32(16)) & T.uint32(1)))"


def bf16_bits(x: str) -> str:
    """The bf16 bits of fp32 ``x`` (round to nearest even) in the low half of a uint32."""
    bits = f'T.reinterpret("uint32", {x})'
    return f"({_round_bf16(bits)} >> T.uint32(16))"


def bf16_pair_of_word(word: str) -> str:
    """The bf16 pair of the two fp32 values in the uint64 ``word`` (the one at the lower
    address first): one uint32 as :func:`bf16_pair` makes it, from one 8-byte load, so a
    vectorized loop reads a row of fp32 pairs contiguously."""
    lo = _round_bf16(f'T.Cast("uint32", {word})')
    hi = _round_bf16(f'T.Cast("uint32", {word} >> T.uint64(32))')
    return f"(({lo} >> T.uint32(16)) | ({hi} & T.uint32(4294901760)))"


def bf16_pair(lo: str, hi: str) -> str:
    """One uint32 word holding the bf16 pair (``lo``, ``hi``): the operand layout of
    ``vdpbf16ps`` and AMX's ``tdpbf16ps``."""
    return f"({bf16_bits(lo)} | ({bf16_bits(hi)} << T.uint32(16)))"
