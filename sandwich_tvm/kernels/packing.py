"""Weight packing: the layout a generated GEMM reads its weight in, as a value (BLIS's packm).

``W[n, k]`` is stored as column panels ``Wp[panels, k / k_pack, lanes * k_pack]``: ``lanes``
output columns side by side for every k, so one vector load feeds one FMA column of the
register tile. n is zero-padded so the last column tile of *every* NR is in bounds. A
``k_pack`` of 2 (``vdpbf16ps``) interleaves k-pairs: the two bf16 values of one column at k
and k + 1 sit next to each other in one 32-bit word, and the panel is stored as ``uint32``.
A gate_up weight for the ``silu_mul`` epilogue is interleaved first (gate and up rows
alternating every ``lanes`` rows). AMX reads 16 k-pairs of a panel as one B tile, so its
layout pads k (zeros) to a multiple of 32 (``k_align`` pairs); otherwise it is the
``avx512bf16`` layout. A block-quantized weight (``q8_0``, ``q4_0``, ``q4_1``: ``quant``) is
stored as ``uint8`` panels of GGUF blocks, ``Wp[panels, k / 32, lanes * block_bytes]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .microkernel import ISAS, microkernels
from .quant import BLOCK, QuantBlocks, qtype
from .schedule import cdiv


class KernelError(ValueError):
    """A schedule, shape or weight the generator cannot turn into a kernel."""


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even, ml_dtypes' numpy dtype)."""
    import ml_dtypes

    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16)


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a TVM dtype name (bfloat16 through ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


@dataclass(frozen=True)
class WeightLayout:
    """How one Linear weight is stored for the kernels of ``isa`` (a micro-kernel ISA)."""

    isa: str
    dtype: str = "float32"  # the weight's precision
    interleave: bool = False  # gate/up rows alternate every ``lanes`` rows (silu_mul)

    def __post_init__(self) -> None:
        if self.isa not in ISAS:
            raise KernelError(f"no kernels for ISA {self.isa!r}; known: {sorted(ISAS)}")
        if self.dtype not in ISAS[self.isa].dtypes:
            raise KernelError(f"{self.isa} kernels do not read {self.dtype} weights "
                            f"(they read {', '.join(ISAS[self.isa].dtypes)})")

    @property
    def lanes(self) -> int:
        return ISAS[self.isa].lanes

    @property
    def k_pack(self) -> int:
        return ISAS[self.isa].k_pack

    @property
    def storage(self) -> str:
        """The parameter's dtype: the weight's, ``uint32`` words of bf16 k-pairs, or the bytes of
        quantized blocks."""
        if self.quant is not None:
            return "uint8"
        return "uint32" if self.k_pack == 2 else self.dtype

    @property
    def quads(self) -> bool:
        """Quantized values in 4-k words for the int8 dot product (``kernels.quant``)."""
        return ISAS[self.isa].int8_dot or ISAS[self.isa].quads

    @property
    def signed(self) -> bool:
        """q8_0's values kept signed in the quads (a signed-by-signed dot product)."""
        return ISAS[self.isa].signed_dot

    @property
    def quant(self):
        """The block type of a quantized weight (``kernels.quant.QType``), else None."""
        return qtype(self.dtype)

    def panels(self, n: int) -> int:
        """n padded so the last column tile of every NR is in bounds (a 24-wide tile over
        n = 2048 reads up to column 2063, past a pad to 32), in panels of ``lanes``."""
        widths = {mk.nr for mk in microkernels(self.isa, self.dtype)} or {ISAS[self.isa].max_nr}
        return max(cdiv(n, w) * w for w in widths) // self.lanes

    def reduction(self, k: int) -> int:
        """Rows of the packed reduction axis: k in ``k_pack`` units, padded to ``k_align``."""
        align = ISAS[self.isa].k_align
        return cdiv(cdiv(k, self.k_pack), align) * align

    def shape(self, n: int, k: int) -> tuple[int, int, int]:
        """Shape of the packed ``W[n, k]``: ``(panels, k / k_pack, lanes)``; quantized:
        ``(panels, k / 32, lanes * block_bytes)``."""
        q = self.quant
        if q is not None:
            q.check_k(k)
            return self.panels(n), k // BLOCK, q.panel_block_bytes(self.lanes)
        return self.panels(n), self.reduction(k), self.lanes

    def pack(self, w: np.ndarray, out: np.ndarray | None = None, importance: np.ndarray | None = None,
             row_sigma2: np.ndarray | None = None) -> np.ndarray:
        """``W[n, k]`` (any float dtype, or ``QuantBlocks`` of this layout's type) -> the packed
        array; written into ``out`` (e.g. a huge-page buffer) when given, saving a copy of the
        whole weight. ``importance[k]``: quantize a 4-bit type weighted by it (``QType.quantize``;
        ``row_sigma2``: each whole row's mean square, where ``w`` is a shard of its columns)."""
        if w.ndim != 2:
            raise KernelError(f"a Linear weight is 2-D, not {list(w.shape)}")
        n, k = w.shape
        panels, kp, lanes = self.shape(n, k)
        q = self.quant
        if q is not None:  # GGUF blocks as they are, or quantized by gguf's reference code
            raw = (w.raw if isinstance(w, QuantBlocks) and w.qtype == q
                   else q.quantize(np.asarray(w), importance, row_sigma2))
            if self.interleave:
                raw = interleave_gate_up(raw, self.lanes)
            return q.to_panels(raw, panels, self.lanes, out, quads=self.quads, signed=self.signed)
        w = np.asarray(w)
        if self.interleave:
            w = interleave_gate_up(w, self.lanes)
        if self.dtype == "bfloat16":
            w = to_bfloat16(w)
        padded = np.zeros((panels * lanes, kp * self.k_pack), dtype=numpy_dtype(self.dtype))
        padded[:n, :k] = w
        if self.k_pack == 1:
            view = padded.reshape(panels, lanes, k).transpose(0, 2, 1)
        else:  # [panel, lane, kp, 2] -> [panel, kp, lane, 2]: k-pairs side by side per lane
            words = padded.view(np.uint16).reshape(panels, lanes, kp, 2).transpose(0, 2, 1, 3)
            view = np.ascontiguousarray(words).view(np.uint32).reshape(panels, kp, lanes)
        if out is None:
            return np.ascontiguousarray(view)
        out[...] = view
        return out

    def element(self, wp, n, k):
        """The fp32 value of ``W[n, k]`` in a packed buffer ``wp`` (a TE/TIR expression): a 16-bit
        value widened, or the half of a k-pair word shifted into an fp32's high bits (exact)."""
        from tvm import tirx

        if self.quant is not None:
            return _quant_element(self.quant, self.lanes, wp, n, k, self.quads, self.signed)
        if self.k_pack == 1:
            return wp[n // self.lanes, k, n % self.lanes].astype("float32")

        word = wp[n // self.lanes, k // 2, n % self.lanes]
        half = (word >> ((k % 2) * 16).astype("uint32")) << tirx.const(16, "uint32")
        return tirx.reinterpret("float32", half)

    def to_json(self) -> dict:
        return {"isa": self.isa, "dtype": self.dtype, "interleave": self.interleave}

    @classmethod
    def from_json(cls, d: dict) -> WeightLayout:
        return cls(str(d["isa"]), str(d["dtype"]), bool(d.get("interleave", False)))

    def unpack(self, wp: np.ndarray, n: int, k: int) -> np.ndarray:
        """The float32 ``W[n, k]`` a packed array holds (tests, debugging)."""
        panels, kp, lanes = wp.shape
        if self.quant is not None:
            raw = self.quant.from_panels(wp, panels * self.lanes, self.quads, self.signed)
            full = self.quant.dequantize(raw)
        elif self.k_pack == 1:
            full = wp.transpose(0, 2, 1).reshape(panels * lanes, kp).astype(np.float32)
        else:
            halves = wp.view(np.uint16).reshape(panels, kp, lanes, 2).transpose(0, 2, 1, 3)
            full = np.ascontiguousarray(halves).reshape(panels * lanes, kp * 2).view(
                numpy_dtype("bfloat16")).astype(np.float32)
        w = full[:n, :k]
        if self.interleave:
            w = deinterleave_gate_up(w, self.lanes)
        return w


def _quant_element(q, lanes: int, wp, n, k, quads: bool = False, signed: bool = False):
    """``W[n, k]`` of quantized panels as an fp32 TE/TIR expression (the embedding gather,
    MetaSchedule's workload): the block's fp16 d (and m) from their two bytes, times the value."""
    from tvm import tirx

    p, w, b, r = n // lanes, n % lanes, k // BLOCK, k % BLOCK

    def half(i: int):
        lo, hi = (wp[p, b, 2 * (i * lanes + w) + j].astype("uint16") for j in (0, 1))
        return tirx.reinterpret("float16", lo | (hi << tirx.const(8, "uint16"))).astype("float32")

    head = 2 * q.header * lanes

    def at(j):  # the byte of value byte j (q8_0: element j; q4: elements j and j + 16)
        return head + (j // 4 * 4 * lanes + w * 4 + j % 4 if quads else j * lanes + w)

    if q.bits == 8:
        byte = wp[p, b, at(r)]
        if quads and not signed:  # stored as q + 128
            byte = byte ^ tirx.const(0x80, "uint8")
        return tirx.reinterpret("int8", byte).astype("float32") * half(0)
    byte = wp[p, b, at(r % 16)]
    nibble = ((byte >> ((r // 16) * 4).astype("uint8")) & tirx.const(15, "uint8")).astype("float32")
    if q.has_min:
        return nibble * half(0) + half(1)
    return (nibble - tirx.const(8, "float32")) * half(0)


def interleave_gate_up(w: np.ndarray, lanes: int) -> np.ndarray:
    """``cat(gate, up)[2I, k]`` with gate and up rows alternating every ``lanes`` rows (the
    layout the ``silu_mul`` epilogue reads)."""
    two_i, k = w.shape
    i = two_i // 2
    if two_i % 2 or i % lanes:
        raise KernelError(f"gate_up of {two_i} rows does not interleave in blocks of {lanes}")
    halves = w.reshape(2, i // lanes, lanes, k)
    return halves.transpose(1, 0, 2, 3).reshape(two_i, k)


def deinterleave_gate_up(w: np.ndarray, lanes: int) -> np.ndarray:
    two_i, k = w.shape
    return w.reshape(two_i // 2 // lanes, 2, lanes, k).transpose(1, 0, 2, 3).reshape(two_i, k)
