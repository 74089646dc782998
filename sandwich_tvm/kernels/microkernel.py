"""Register micro-kernels: the MR x NR tiles a GEMM is built from, enumerated per (ISA, dtype).

A micro-kernel keeps an MR x NR block of C in vector registers while it walks the reduction
axis: per k step it loads NR/lanes vectors of B, broadcasts MR scalars of A and issues
MR * NR/lanes FMAs. It fits when accumulators + B vectors + one broadcast register stay
within the register file (BLIS's rule; spilling costs more than a smaller tile).

The dtype is the weight's storage precision; accumulation is fp32 everywhere. On the plain
vector ISAs a 16-bit weight is widened to fp32 as it is loaded (bf16: a 16-bit shift; f16:
``vcvtph2ps``) and the tile is the fp32 one. ``avx512bf16`` and ``neonbf16`` are ISAs of their
own: ``vdpbf16ps`` (x86) and ``bfdot`` (Armv8.6 BF16) multiply *pairs* along k (A rounded to
bf16 when it is packed, B packed with k-pairs interleaved), so one instruction does two k steps
of the tile.

``amx`` is a *tile* ISA: eight tile registers of 16 rows x 64 bytes, and ``tdpbf16ps`` adds a
16 x 32 bf16 A tile times a 16 (k-pairs) x 16 (columns) B tile into a 16 x 16 fp32 tile. Its
micro-kernels are grids of tm x tn accumulator tiles fed by tm A tiles and tn B tiles (the
budget is tm * tn + tm + tn <= 8 tiles: 16x16 up to 32x32, oneDNN's 2x2). Its B tile is one
``avx512bf16`` panel block (16 columns of k-pairs, 64 bytes per pair row), so the two share a
weight layout (both pad k to whole B tiles, ``k_align``) and an AMX CPU also serves its small
m with the ``avx512bf16`` register tiles (``extends``): a tile of 16 rows wastes 15 of them on
one decode row.

Block-quantized weights (``q8_0``, ``q4_0``, ``q4_1``, ``kernels.quant``) are dequantized in
registers on every vector ISA (the block's d times the widened value, then the fp32 FMA tile).
``avx512vnni`` is their integer ISA: the activations are quantized per row and block of 32 to
int8 as the kernel packs A (llama.cpp's q8_0 activations), ``vpdpbusd`` multiplies 4 unsigned
weight bytes by 4 signed activation bytes per int32 lane, and each block's int32 sums are scaled
into the fp32 tile. A tile keeps int32 block sums beside its fp32 accumulators, so it holds half
the rows of an fp32 one. ``avxvnni`` is the same kernel in 8 lanes on AVX2 CPUs with AVX-VNNI
(the VEX-encoded ``{vex} vpdpbusd``), ``avx2dot`` on AVX2 CPUs without it (``vpmaddubsw`` then
``vpmaddwd``, llama.cpp's AVX2 dot product), ``avx512dot`` the same in 16 lanes on AVX-512 CPUs
without VNNI (Skylake-SP), ``neondot`` on Arm's dot-product extension (``sdot``: signed by signed
bytes). Those three keep q8_0's values signed (``signed_dot``). ``amxint8`` multiplies
16 x 32 int8 A tiles by 8 (k-quads) x 16 B tiles with ``tdpbsud`` (signed activations, unsigned
weights: the ``avx512vnni`` layout, whose small m it also runs) one 32-k block at a time, and
scales each block's 16 x 16 int32 tile into fp32 with AVX-512 (llama.cpp's AMX path does the
same: the scales change every block).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..host import BF16_UNITS, INT8_UNITS
from .quant import BLOCK, QTYPES


@dataclass(frozen=True)
class Isa:
    """What a micro-kernel needs to know about a vector ISA (BLIS's ``config/<arch>``).

    ``default_tiles`` are the untuned register tiles, ``(largest m, MR, NR in vectors)`` per m
    range (thin tiles for decode-sized m). Large m: BLIS's 6x16 on AVX2; 4x64 on AVX-512, the
    fastest of 3x64, 4x64, 6x64, 7x32 and 14x32 untuned at m = 256 on a Zen 4 (the tuner's
    choice at large m there too); 6x16 on NEON (24 of its 32 registers).
    """

    name: str
    lanes: int  # fp32 lanes per vector register
    registers: int  # architectural vector registers
    cache_line: int = 64  # bytes
    default_tiles: tuple[tuple[int, int, int], ...] = ()
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16", *QTYPES)  # weight dtypes it computes
    k_pack: int = 1  # k steps one instruction reduces (2: bf16 pairs)
    needs: tuple[str, ...] = ()  # CPU flags beyond the base ISA's
    tile_rows: int = 0  # rows per tile register (AMX: 16); 0 for a vector ISA
    k_align: int = 1  # the packed weight's k (in k_pack units) is padded to a multiple of this
    extends: tuple[str, ...] = ()  # ISAs whose micro-kernels also serve this one's layout
    peak_ratio: float = 1.0  # peak MACs per cycle over the vector ISA's (AMX bf16: 512 vs 64)
    int8_dot: bool = False  # quantized weights times int8 activations (vpdpbusd)
    signed_dot: bool = False  # the int8 dot multiplies signed weights (sdot), not unsigned
    quads: bool = False  # reads the int8 dot products' weight layout with 16-bit activations (amxdq)
    emulated_dot: bool = False  # no dot instruction: two multiply-adds a quad step (avx2dot)

    @property
    def quantized_unit(self) -> bool:
        """A unit for quantized weights beside the vector ISA's dequantizing loads (int8 dot
        products, or AMX tiles on dequantized slices): what ``--activations auto`` picks."""
        return self.int8_dot or self.quads

    @property
    def max_nr(self) -> int:
        return 4 * self.lanes

    @property
    def kc_align(self) -> int:
        """KC is a multiple of one cache line of fp32 values."""
        return self.cache_line // 4


_LARGE = 1 << 62
ISAS: dict[str, Isa] = {
    "avx2": Isa("avx2", lanes=8, registers=16,
                default_tiles=((1, 1, 4), (2, 2, 3), (4, 4, 3), (_LARGE, 6, 2))),
    "avx512": Isa("avx512", lanes=16, registers=32,
                  default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 4), (_LARGE, 4, 4))),
    "neon": Isa("neon", lanes=4, registers=32,
                default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 4), (_LARGE, 6, 4))),
    "avx512bf16": Isa("avx512bf16", lanes=16, registers=32,
                      default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 4), (_LARGE, 4, 4)),
                      dtypes=("bfloat16",), k_pack=2, needs=("avx512_bf16",), k_align=16),
    "neonbf16": Isa("neonbf16", lanes=4, registers=32,
                    default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 4), (_LARGE, 6, 4)),
                    dtypes=("bfloat16",), k_pack=2, needs=("bf16",)),
    "avx512vnni": Isa("avx512vnni", lanes=16, registers=32,
                      default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 2), (_LARGE, 6, 2)),
                      dtypes=tuple(QTYPES), needs=("avx512_vnni",), int8_dot=True, peak_ratio=2.0),
    "avxvnni": Isa("avxvnni", lanes=8, registers=16,
                   default_tiles=((1, 1, 2), (2, 2, 2), (4, 4, 1), (_LARGE, 6, 1)),
                   dtypes=tuple(QTYPES), needs=("avx_vnni",), int8_dot=True, peak_ratio=2.0),
    # AVX2 CPUs without VNNI: vpmaddubsw + vpmaddwd for each quad step (codegen's avx2dot), q8_0's
    # values signed (|w| and the activation's sign). The product and the ones take two registers,
    # |w| one per weight vector.
    "avx2dot": Isa("avx2dot", lanes=8, registers=16,
                   default_tiles=((1, 1, 2), (2, 2, 1), (4, 4, 1), (_LARGE, 4, 1)),
                   dtypes=tuple(QTYPES), int8_dot=True, signed_dot=True, emulated_dot=True),
    # AVX-512 CPUs without VNNI (Skylake-SP): avx2dot's two multiply-adds in 16 lanes, the sign
    # of q8_0's values moved onto the activations by a masked negation (AVX-512 has no vpsignb).
    "avx512dot": Isa("avx512dot", lanes=16, registers=32,
                     default_tiles=((1, 1, 4), (2, 2, 2), (4, 4, 2), (_LARGE, 4, 2)),
                     dtypes=tuple(QTYPES), needs=("avx512bw",), int8_dot=True, signed_dot=True,
                     emulated_dot=True),
    "neondot": Isa("neondot", lanes=4, registers=32,
                   default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 2), (_LARGE, 6, 2)),
                   dtypes=tuple(QTYPES), needs=("asimddp",), int8_dot=True, signed_dot=True,
                   peak_ratio=2.0),
    # registers: tile registers; default tiles 16x32 and 32x32 (MR, NR in 16-column tiles)
    "amx": Isa("amx", lanes=16, registers=8,
               default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 4), (15, 4, 4), (31, 16, 2), (_LARGE, 32, 2)),
               dtypes=("bfloat16",), k_pack=2, needs=("amx_bf16", "amx_tile", "avx512_bf16"),
               tile_rows=16, k_align=16, extends=("avx512bf16",), peak_ratio=8.0),
    # tdpbsud per 32-k block, then the block's scales in AVX-512. Untuned, every m runs the
    # avx512vnni tiles: the AMX grids' per-block scaling made them 0.72-1.12x the VNNI tiles on a
    # Xeon (docs/quant/xeon/crosscheck.json); the search weighs both. peak_ratio: as measured.
    "amxint8": Isa("amxint8", lanes=16, registers=8,
                   default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 2), (_LARGE, 6, 2)),
                   dtypes=tuple(QTYPES), needs=("amx_int8", "amx_tile", "avx512_vnni"), tile_rows=16,
                   extends=("avx512vnni",), int8_dot=True, peak_ratio=1.8),
    # AMX-BF16 tiles on quantized weights: each thread dequantizes its KC x NC slice of the
    # avx512vnni layout to bf16 pairs once per call and runs amx's tdpbf16ps grids on it (A in
    # bf16), as oneDNN's weight-only quantization does. Untuned: m < 32 on avx512vnni tiles (a
    # 16x32 grid ran 0.55-0.7x them at m = 16), 32x32 grids above (1.2-1.8x them at m = 64-512 on
    # a Xeon, docs/quant/xeon/crosscheck_amxdq.json). peak_ratio: as measured.
    "amxdq": Isa("amxdq", lanes=16, registers=8,
                 default_tiles=((1, 1, 4), (2, 2, 4), (4, 4, 2), (31, 6, 2), (_LARGE, 32, 2)),
                 dtypes=tuple(QTYPES), needs=("amx_bf16", "amx_tile", "avx512_vnni", "avx512_bf16"),
                 tile_rows=16, extends=("avx512vnni",), quads=True, peak_ratio=3.5),
}
DTYPES = ("float32", "bfloat16", "float16", *QTYPES)


def kernel_isa(isa: str, dtype: str, flags: frozenset[str] | set[str] = frozenset(),
               int8: bool = True) -> str:
    """The micro-kernel ISA for weights of ``dtype`` on a CPU of vector ISA ``isa`` with ``flags``:
    the bf16 dot-product unit where the CPU has it, for quantized weights its int8 dot-product
    unit (unless ``int8`` is off: fp32 activations), else the vector ISA (widening loads)."""
    if dtype not in DTYPES:
        raise ValueError(f"weight dtype {dtype!r} is not one of {DTYPES}")
    units = BF16_UNITS if dtype == "bfloat16" else INT8_UNITS if dtype in QTYPES and int8 else {}
    for unit in units.get(isa, ()):
        if set(ISAS[unit].needs) <= set(flags):
            return unit
    return isa


@dataclass(frozen=True, order=True)
class MicroKernel:
    """An MR x NR fp32 register tile on one ISA (a value: hashable, JSON-able)."""

    isa: str
    mr: int
    nr: int
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"gemm_{_short(self.dtype)}_{self.isa}_{self.mr}x{self.nr}"

    @property
    def lanes(self) -> int:
        return ISAS[self.isa].lanes

    @property
    def k_pack(self) -> int:
        return ISAS[self.isa].k_pack

    @property
    def tiles(self) -> tuple[int, int]:
        """An AMX micro-kernel's grid of accumulator tiles (rows, columns); (0, 0) for a vector one."""
        rows = ISAS[self.isa].tile_rows
        return (self.mr // rows, self.nr // self.lanes) if rows else (0, 0)

    @property
    def registers_used(self) -> int:
        vectors = self.nr // self.lanes
        if ISAS[self.isa].tile_rows:  # accumulator tiles + A tiles + B tiles
            tm, tn = self.tiles
            return tm * tn + tm + tn
        if ISAS[self.isa].int8_dot:  # fp32 and int32 accumulators, B, d and offset, A
            emulation = vectors + 2 if ISAS[self.isa].emulated_dot else 0  # |B|, product, ones
            return 2 * self.mr * vectors + 3 * vectors + 1 + emulation
        scales = vectors * QTYPES[self.dtype].header if self.dtype in QTYPES else 0  # d (and m) per column
        return self.mr * vectors + vectors + 1 + scales

    @property
    def kc_align(self) -> int:
        """KC is a whole number of cache lines of fp32 values, and of 32-k blocks for a
        block-quantized weight."""
        align = ISAS[self.isa].kc_align
        return max(align, BLOCK) if self.dtype in QTYPES else align

    @property
    def k_partials(self) -> int:
        """Independent partial sums along k, so a thin tile still has enough FMA chains.

        An FMA unit needs latency x pipes (4 x 2 on current x86 and Arm cores) independent
        accumulators to stay busy; a 1x16 tile has only 2, so it keeps 4 k-partials.
        """
        spec, vectors = ISAS[self.isa], self.nr // self.lanes
        if spec.tile_rows or spec.int8_dot:
            return 1
        ku = 1
        while ku * 2 * self.mr * vectors <= 8 and (ku * 2 * self.mr + 1) * vectors + 1 <= spec.registers:
            ku *= 2
        return ku

    @property
    def column_bytes(self) -> int:
        """Bytes of one vector column of accumulators (every k-partial): the code generator
        keeps each column in its own buffer, which TVM puts on the stack only under 1 KB."""
        return self.k_partials * self.mr * self.lanes * 4

    def to_json(self) -> dict:
        return {"isa": self.isa, "mr": self.mr, "nr": self.nr, "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> MicroKernel:
        return cls(isa=d["isa"], mr=int(d["mr"]), nr=int(d["nr"]), dtype=d.get("dtype", "float32"))


def _short(dtype: str) -> str:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(dtype, dtype)  # q8_0 as itself


STACK_BYTES = 1024  # TVM's kMaxStackAlloca: larger block buffers become heap workspaces


def enumerate_microkernels(isa: str, dtype: str = "float32") -> tuple[MicroKernel, ...]:
    """Every tile whose accumulators, B vectors and broadcast fit the register file and whose
    accumulator columns fit TVM's stack allocation (else they leave the registers)."""
    if isa not in ISAS:
        raise ValueError(f"no micro-kernels for ISA {isa!r}; known: {sorted(ISAS)}")
    spec = ISAS[isa]
    if dtype not in spec.dtypes:
        return ()
    kernels = []
    if spec.tile_rows:
        for tm in range(1, spec.registers):
            for tn in range(1, spec.registers):
                mk = MicroKernel(isa, tm * spec.tile_rows, tn * spec.lanes, dtype)
                if mk.registers_used <= spec.registers:
                    kernels.append(mk)
        return tuple(kernels)
    for vectors in range(1, 5):
        nr = vectors * spec.lanes
        for mr in range(1, 33):
            mk = MicroKernel(isa, mr, nr, dtype)
            if mk.registers_used > spec.registers:
                break
            if mk.column_bytes < STACK_BYTES and (not spec.int8_dot or mr * nr * 4 < STACK_BYTES):
                kernels.append(mk)
    return tuple(kernels)


# (ISA, weight dtype) -> its micro-kernels; an ISA alone means float32.
REGISTRY: dict[str | tuple[str, str], tuple[MicroKernel, ...]] = {
    (isa, dt): enumerate_microkernels(isa, dt) for isa in ISAS for dt in DTYPES}
REGISTRY.update({isa: REGISTRY[(isa, "float32")] for isa in ISAS})


def microkernels(isa: str, dtype: str = "float32") -> tuple[MicroKernel, ...]:
    """The micro-kernels that serve ``isa``'s weight layout: its own and those it ``extends``."""
    if isa not in ISAS:
        return ()
    return tuple(mk for name in (isa, *ISAS[isa].extends) for mk in REGISTRY.get((name, dtype), ()))
