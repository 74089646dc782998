"""Block-quantized weight types as llama.cpp names them, bit-compatible with GGUF's blocks.

A block holds 32 consecutive k of one row (one output column of ``Y = X @ W.T``):

- ``q8_0``: an fp16 scale d and 32 int8 q; w = q * d (8.5 bits a weight);
- ``q4_0``: d and 32 4-bit q (two a byte); w = (q - 8) * d (4.5 bits);
- ``q4_1``: d, an fp16 minimum m and 32 4-bit q; w = q * d + m (5 bits).

GGUF stores a row as consecutive blocks (``d [m] qs``; a q4 byte j holds element j in its
low nibble and element j + 16 in its high one). The kernels read them regrouped per
``lanes`` columns (``to_panels``): for every panel of ``lanes`` rows and every block of k,
the lanes' d values, then their m values (q4_1), then the values as ``[byte][lane]``, so that
one vector load holds the same k of ``lanes`` columns. The bytes are the GGUF ones, moved:
a GGUF file loads without re-quantizing, and an HF checkpoint is quantized with ``gguf``'s
own reference code (``gguf.quants``), so both give llama.cpp's values; given an importance
matrix, 4-bit blocks are rounded by ``weighted_blocks`` instead, as ``llama-quantize --imatrix``
rounds them.

The int8 dot-product layout (``quads``, for ``vpdpbusd``) keeps 4 consecutive k of a column in
one 32-bit word, ``[quad][lane][4]``, and stores q8_0's values offset to unsigned (q + 128, a
flip of the sign bit): the instruction multiplies unsigned by signed bytes, and the offset is
taken back with the activations' block sums (Arm's ``sdot`` multiplies signed bytes: there the
values stay as they are). A q4 byte of quad j holds elements 4j..4j+3 in its
low nibbles and 16 + 4j.. in its high ones, which is GGUF's own byte order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BLOCK = 32  # k per block


@dataclass(frozen=True)
class QType:
    """One block-quantized weight type."""

    name: str
    gguf: str  # GGMLQuantizationType member name
    bits: int  # bits per value: 8 or 4
    has_min: bool  # q4_1's per-block minimum

    @property
    def header(self) -> int:
        """fp16 values (d, and m) before a block's values, per column."""
        return 2 if self.has_min else 1

    @property
    def value_bytes(self) -> int:
        return BLOCK * self.bits // 8

    @property
    def block_bytes(self) -> int:
        """Bytes of one column's block: the GGUF block size (34, 18, 20)."""
        return 2 * self.header + self.value_bytes

    def panel_block_bytes(self, lanes: int) -> int:
        return lanes * self.block_bytes

    def check_k(self, k: int) -> None:
        if k % BLOCK:
            from .packing import KernelError

            raise KernelError(f"{self.name} weights come in blocks of {BLOCK} along k, and k = {k} is "
                              f"not a multiple of {BLOCK}; use --dtype bfloat16 for this model")

    def quantize(self, w: np.ndarray, importance: np.ndarray | None = None,
                 row_sigma2: np.ndarray | None = None) -> np.ndarray:
        """``W[n, k]`` (float) -> GGUF blocks ``[n, k / 32 * block_bytes]`` (uint8), by gguf's
        reference quantizer (llama.cpp's rounding); a 4-bit type given ``importance`` (an
        importance matrix's mean squared activation per k) by ``weighted_blocks``."""
        import gguf

        self.check_k(w.shape[1])
        w = np.ascontiguousarray(w, dtype=np.float32)
        if importance is not None and self.bits == 4:
            return weighted_blocks(w, importance, self, row_sigma2)
        return gguf.quants.quantize(w, self._gguf_type)

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """GGUF blocks ``[n, bytes]`` -> float32 ``W[n, k]``."""
        import gguf

        return gguf.quants.dequantize(np.ascontiguousarray(raw), self._gguf_type)

    @property
    def _gguf_type(self):
        import gguf

        return gguf.GGMLQuantizationType[self.gguf]

    def to_panels(self, raw: np.ndarray, panels: int, lanes: int,
                  out: np.ndarray | None = None, quads: bool = False, signed: bool = False) -> np.ndarray:
        """GGUF blocks of ``n <= panels * lanes`` rows -> ``[panels, k / 32, lanes * block_bytes]``
        uint8 (rows past n are zero blocks: d = 0); ``quads``: the int8 dot-product layout, q8_0's
        values offset to unsigned unless the dot product is ``signed`` (Arm's sdot)."""
        n, nbytes = raw.shape
        kb = nbytes // self.block_bytes
        rows = np.zeros((panels * lanes, kb, self.block_bytes), np.uint8)
        rows[:n] = raw.reshape(n, kb, self.block_bytes)
        # [panel, lane, block, byte] -> [panel, block, byte, lane]: header halves and values lane-minor
        grid = rows.reshape(panels, lanes, kb, self.block_bytes).transpose(0, 2, 3, 1)
        head = 2 * self.header
        halves = grid[:, :, :head].reshape(panels, kb, self.header, 2, lanes).transpose(0, 1, 2, 4, 3)
        values = grid[:, :, head:]  # [panel, block, byte, lane]
        if quads:  # [quad, 4, lane] -> [quad, lane, 4]
            values = values.reshape(panels, kb, -1, 4, lanes).transpose(0, 1, 2, 4, 3)
            if self.bits == 8 and not signed:
                values = values ^ np.uint8(0x80)
        packed = np.concatenate([halves.reshape(panels, kb, head * lanes),
                                 values.reshape(panels, kb, self.value_bytes * lanes)], axis=2)
        if out is None:
            return np.ascontiguousarray(packed)
        out[...] = packed
        return out

    def from_panels(self, packed: np.ndarray, n: int, quads: bool = False,
                    signed: bool = False) -> np.ndarray:
        """The inverse of ``to_panels``: GGUF blocks of the first ``n`` rows."""
        panels, kb, pbb = packed.shape
        lanes = pbb // self.block_bytes
        head = 2 * self.header
        halves = packed[:, :, :head * lanes].reshape(panels, kb, self.header, lanes, 2)
        halves = halves.transpose(0, 1, 2, 4, 3)
        values = packed[:, :, head * lanes:].reshape(panels, kb, self.value_bytes, lanes)
        if quads:
            values = values.reshape(panels, kb, -1, lanes, 4).transpose(0, 1, 2, 4, 3)
            values = values.reshape(panels, kb, self.value_bytes, lanes)
            if self.bits == 8 and not signed:
                values = values ^ np.uint8(0x80)
        grid = np.concatenate([halves.reshape(panels, kb, head, lanes), values], axis=2)
        rows = grid.transpose(0, 3, 1, 2).reshape(panels * lanes, kb * self.block_bytes)
        return np.ascontiguousarray(rows[:n])


WEIGHTED_FORMAT = 2  # keys converted weights: bump it when weighted_blocks rounds differently
SCALE_STEPS = np.arange(-10, 11) * 0.1  # the inverse scales tried: the range mapped to 16 + step levels


def weighted_blocks(w: np.ndarray, importance: np.ndarray, qtype: QType,
                    row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """4-bit GGUF blocks of ``W[n, k]`` that minimize the error weighted by ``importance[k]``.

    What an importance matrix (llama.cpp's ``llama-imatrix``) is for: a column of W that
    meets large activations costs more when rounded. Each block's weight of element j is
    ``importance[j] * sqrt(sigma2 + w[j]^2)`` (sigma2: the row's mean square, llama.cpp's
    choice; ``row_sigma2`` gives it for a row of which ``w`` holds only some columns, a
    tensor-parallel shard). For each of ``SCALE_STEPS`` the block is rounded onto a grid
    spanning its range (q4_0: the largest magnitude onto -8; q4_1: min..max onto 0..15 +
    step), the scale (and minimum) refitted by weighted least squares to those levels, and the
    candidate with the smallest weighted squared error kept. The blocks decode with the
    unchanged formats.
    """
    n, k = w.shape
    imp = np.asarray(importance, np.float32).reshape(-1)
    if imp.shape != (k,):
        raise ValueError(f"an importance vector must hold {k} values (one per input column), not {imp.size}")
    if not np.all(np.isfinite(imp)) or np.any(imp < 0):
        raise ValueError("an importance vector must hold finite values >= 0")
    if row_sigma2 is None:
        row_sigma2 = row_mean_square(w)
    out = np.empty((n, k // BLOCK * qtype.block_bytes), np.uint8)
    step = max(1, (1 << 20) // k)  # rows at a time: the candidates' temporaries stay a few MB
    for r in range(0, n, step):
        out[r:r + step] = _weighted_rows(w[r:r + step], imp, qtype, np.asarray(row_sigma2)[r:r + step])
    return out


def row_mean_square(w: np.ndarray) -> np.ndarray:
    """Each row's mean square: ``weighted_blocks``' sigma2, from a whole row (pass it for shards)."""
    return np.mean(np.square(np.asarray(w), dtype=np.float64), axis=1)


def _weighted_rows(w: np.ndarray, imp: np.ndarray, qtype: QType, sigma2: np.ndarray) -> np.ndarray:
    n, k = w.shape
    x = w.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    wt = imp.reshape(1, k // BLOCK, BLOCK) * np.sqrt(sigma2.astype(np.float32)[:, None, None] + x * x)
    wt = np.where(wt.sum(axis=2, keepdims=True) > 0, wt, np.float32(1))  # a block nobody weighs: plain error
    best_err = np.full(x.shape[:2], np.inf, np.float32)
    best_q = np.zeros(x.shape, np.uint8)
    best_d = np.zeros(x.shape[:2], np.float32)
    best_m = np.zeros(x.shape[:2], np.float32)
    lo, hi = x.min(axis=2), x.max(axis=2)
    peak = np.where(-lo > hi, lo, hi)  # the signed value of largest magnitude (q4_0)
    for step in SCALE_STEPS.astype(np.float32):
        if qtype.has_min:  # q = round((x - lo) / d) in 0..15, then (d, m) refitted
            inv = np.divide(15 + step, hi - lo, out=np.zeros_like(hi), where=hi > lo)
            q = np.clip(np.rint((x - lo[..., None]) * inv[..., None]), 0, 15)
            d, m = _fit_scale_min(x, q, wt)
            err = np.sum(wt * np.square(x - d[..., None] * q - m[..., None]), axis=2)
        else:  # w = (q - 8) d: the peak maps onto -8 (the level with no positive twin)
            inv = np.divide(-(8 + step), peak, out=np.zeros_like(peak), where=peak != 0)
            c = np.clip(np.rint(x * inv[..., None]), -8, 7)
            wc = wt * c
            den = np.sum(wc * c, axis=2)
            d = np.divide(np.sum(wc * x, axis=2), den, out=np.zeros_like(den), where=den > 0)
            m = np.zeros_like(d)
            q = c + 8
            err = np.sum(wt * np.square(x - d[..., None] * c), axis=2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_q = np.where(better[..., None], q, best_q).astype(np.uint8)
        best_d, best_m = np.where(better, d, best_d), np.where(better, m, best_m)
    head = [best_d.astype(np.float16).view(np.uint8).reshape(n, -1, 2)]
    if qtype.has_min:
        head.append(best_m.astype(np.float16).view(np.uint8).reshape(n, -1, 2))
    nibbles = best_q[..., :16] | (best_q[..., 16:] << 4)  # element j low, j + 16 high (GGUF's order)
    return np.concatenate([*head, nibbles], axis=2).reshape(n, -1)


def _fit_scale_min(x: np.ndarray, q: np.ndarray, wt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the (d, m) that minimize sum(wt (x - d q - m)^2) for fixed levels q: the
    weighted regression of x on q, with q centered (no cancellation in fp32)."""
    sw = wt.sum(axis=2)
    qbar, xbar = np.sum(wt * q, axis=2) / sw, np.sum(wt * x, axis=2) / sw
    qc = q - qbar[..., None]
    den = np.sum(wt * qc * qc, axis=2)
    d = np.divide(np.sum(wt * qc * x, axis=2), den, out=np.zeros_like(den), where=den > 1e-6 * sw)
    return d, xbar - d * qbar  # one level used (den 0): d = 0, m the weighted mean


QTYPES: dict[str, QType] = {
    "q8_0": QType("q8_0", "Q8_0", 8, False),
    "q4_0": QType("q4_0", "Q4_0", 4, False),
    "q4_1": QType("q4_1", "Q4_1", 4, True),
}


def head_dtype(dtype: str) -> str:
    """The lm_head's (and tied embedding's) weight type for a model in ``dtype``: q8_0 under the
    4-bit types, as llama.cpp's quantizer keeps the output layer at higher precision (SmolLM2's
    Q4_1 GGUF holds its tied embedding as Q8_0); otherwise ``dtype``."""
    return "q8_0" if dtype in ("q4_0", "q4_1") else dtype


def qtype(dtype: str) -> QType | None:
    """The block type of a weight dtype name, None for a float dtype."""
    return QTYPES.get(dtype)


class QuantBlocks:
    """A weight held as GGUF blocks (``raw[n, k / 32 * block_bytes]``), not as floats: what a
    quantized GGUF tensor gives the loader so that it is packed without re-quantizing.

    ``raw`` may be given as a function that makes it each time it is read (``later``: a Q4_K
    tensor regrouped as q4_1 blocks, ``kernels.kquant``; not kept, so a checkpoint's state
    holds no copy while the other tensors convert), and ``values`` as one that gives the exact
    float weights, which then stand for the blocks wherever a float or another type is asked
    for (a regrouping rounds the blocks' scales to fp16)."""

    def __init__(self, raw: np.ndarray, qtype: QType, k: int, values: Callable[[], np.ndarray] | None = None):
        self._raw: np.ndarray | Callable[[], np.ndarray] = raw
        self.qtype, self.k, self._values, self._rows = qtype, k, values, raw.shape[0]

    @classmethod
    def later(cls, make: Callable[[], np.ndarray], rows: int, qtype: QType, k: int,
              values: Callable[[], np.ndarray] | None = None) -> QuantBlocks:
        """Blocks that ``make()`` builds whenever they are read, of ``rows`` rows."""
        blocks = cls(np.empty((rows, 0), np.uint8), qtype, k, values)
        blocks._raw = make
        return blocks

    @property
    def raw(self) -> np.ndarray:
        return self._raw() if callable(self._raw) else self._raw

    @property
    def shape(self) -> tuple[int, int]:
        return (self._rows, self.k)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def exact(self) -> bool:
        """Whether the float weights come from elsewhere than the blocks (``values``)."""
        return self._values is not None

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        w = self._values() if self._values is not None else self.qtype.dequantize(self.raw)
        return w if dtype is None else w.astype(dtype)

    @staticmethod
    def concat(parts: list[QuantBlocks]) -> QuantBlocks:
        values = (None if not any(p.exact for p in parts)
                  else (lambda: np.concatenate([np.asarray(p, np.float32) for p in parts], axis=0)))
        return QuantBlocks.later(lambda: np.concatenate([p.raw for p in parts], axis=0),
                                 sum(p.shape[0] for p in parts), parts[0].qtype, parts[0].k, values)
