"""TensorIR generation for the Linear pattern ``Y[m, n] = X[m, k] @ W[n, k].T`` with symbolic m.

The generated PrimFunc follows BLIS: X is packed into MR-row panels (zero rows past m, so
every tile is full and the hot loop has no predicate), W arrives prepacked in ``lanes``-wide
panels ``Wp[n_pad / L, k, L]``; each thread of the polymerization grid walks its block with
the loops JC (NC) -> PC (KC) -> IC (MC) -> JR (NR) -> IR (MR) and runs the register tile.
Tails are explicit: rows past m are never stored, the last column tile stores only n % NR
columns, the last KC block has its own static length. Split-K threads write partial sums
that a final parallel pass adds up.

Epilogues are fused into the store of the register tile: ``residual`` adds ``R[m, n]`` (the
decoder's skip connection), ``bias`` adds ``B[n]``. ``silu_mul`` is the MLP's
``silu(gate) * up`` on a gate_up weight packed with ``interleave_gate_up``: gate and up
columns alternate every ``lanes`` columns, so a tile of an even number of vectors holds whole
(gate, up) pairs and writes ``Y[m, n / 2]`` straight from its registers. Tiles of an odd
number of vectors, split-K and several KC blocks per thread need the whole sum first: they
write the GEMM to a scratch buffer and a parallel pass applies the epilogue.

AMX tiles (``gemm_bf16_amx_*``, ``amx``) take the same loop nest: A is packed into 16-row x
16-pair tiles (1 KB each), each thread loads the tile configuration first, the register tile
becomes tm x tn accumulator tiles over whole 16-pair k steps, and the accumulators are stored
to the thread's slot of a scratch ``C`` from which the ordinary store (tails, epilogues, KC
blocks and split-K partials) reads.

Trap (notes §2): the accumulator must be a small *global*-scope block buffer: TVM then puts
it on the stack and LLVM keeps it in registers; ``local`` scope becomes a workspace
allocation whose stores stay in the hot loop (3x slower). "Small" is under 1 KB (TVM's
``kMaxStackAlloca``): larger buffers are heap workspaces LLVM cannot keep in registers, which
an AVX-512 tile such as 6x64 (1.5 KB) would be. Such tiles get one accumulator buffer per
vector column, ``acc<q>[k-partial, MR, lanes]`` (the micro-kernel enumeration keeps a column
under 1 KB), with the columns unrolled in the generated text; smaller tiles keep one
``acc[k-partial, MR, NR]``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from ..tvm_compat import parse_tvmscript, tvm
from .amx import amx, int8_tile_shapes, tile_config, tile_kloop
from .microkernel import ISAS, STACK_BYTES
from .packing import KernelError, WeightLayout
from .quant import BLOCK, qtype
from .schedule import EPILOGUES, GemmSchedule, GemmShape, cdiv
from .vecmath import bf16_bits, bf16_pair_of_word, silu_mul


def packed_panels(n: int, isa: str, dtype: str = "float32") -> int:
    return WeightLayout(isa, dtype).panels(n)


class _Acc:
    """The register tile's accumulator: one buffer, or one per vector column when the tile would
    not fit TVM's stack allocation. ``columns(ii)`` lists ``(loop var, width, column offset,
    element)`` for the output columns of row ``ii``; ``vectors(n, body)`` emits ``body(q)`` for
    vector columns ``q < n`` (a ``T.unroll`` loop, or unrolled text for split buffers)."""

    def __init__(self, ku: int, mr: int, nr: int, lanes: int) -> None:
        self.ku, self.mr, self.nr, self.lanes = ku, mr, nr, lanes
        self.split = ku * mr * nr * 4 >= STACK_BYTES

    def alloc(self) -> list[str]:
        if self.split:
            return [f'acc{q} = T.sblock_alloc_buffer(({self.ku}, {self.mr}, {self.lanes}), "float32", '
                    'scope="global")' for q in range(self.nr // self.lanes)]
        return [f'acc = T.sblock_alloc_buffer(({self.ku}, {self.mr}, {self.nr}), "float32", scope="global")']

    def ramp(self, u: str, ii: str, q: str) -> str:
        """Vector column ``q`` as one ramp access."""
        if self.split:
            return f"acc{q}[{u}, {ii}, T.ramp(0, 1, {self.lanes})]"
        return f"acc[{u}, {ii}, T.ramp({q} * {self.lanes}, 1, {self.lanes})]"

    def vec(self, u: str, ii: str, q: str, w: str) -> str:
        """Lane ``w`` of vector column ``q`` (a literal when split)."""
        return f"acc{q}[{u}, {ii}, {w}]" if self.split else f"acc[{u}, {ii}, {q} * {self.lanes} + {w}]"

    def vectors(self, count: int, body) -> list[str]:
        if self.split:
            return [ln for q in range(count) for ln in body(str(q))]
        return [f"for q in T.unroll({count}):", *_indent(body("q"), 1)]

    def columns(self, ii: str) -> list[tuple[str, int, str, object]]:
        if self.split:
            return [("w", self.lanes, f"{q * self.lanes} + ",
                     lambda u, q=q: f"acc{q}[{u}, {ii}, w]") for q in range(self.nr // self.lanes)]
        return [("jj", self.nr, "", lambda u: f"acc[{u}, {ii}, jj]")]


class _TileAcc(_Acc):
    """An AMX tile's accumulator: the tile registers, stored once per tile into this thread's
    slot ``C<v>[t, MR, NR]`` of a buffer allocated once per call (a tile of 16 x 16 fp32 is
    1 KB, which TVM would otherwise allocate from the workspace pool for every tile)."""

    def __init__(self, buf: str, mr: int, nr: int, lanes: int) -> None:
        super().__init__(1, mr, nr, lanes)
        self.buf, self.split = buf, False

    def alloc(self) -> list[str]:
        return []

    def vec(self, u: str, ii: str, q: str, w: str) -> str:
        return f"{self.buf}[t, {ii}, {q} * {self.lanes} + {w}]"

    def columns(self, ii: str) -> list[tuple[str, int, str, object]]:
        return [("jj", self.nr, "", lambda u: f"{self.buf}[t, {ii}, jj]")]


@dataclass(frozen=True)
class Bucket:
    """Rows ``m <= m_max`` (the last bucket: every larger m) run ``schedule``."""

    m_max: int
    schedule: GemmSchedule


def check_schedule(shape: GemmShape, sch: GemmSchedule) -> None:
    mk, s = sch.mk, sch.slice
    if mk.dtype != shape.dtype:
        raise KernelError(f"micro-kernel {mk.name} computes {mk.dtype} weights, not {shape.dtype}")
    if mk.dtype not in ISAS[mk.isa].dtypes:
        raise KernelError(f"{mk.isa} micro-kernels do not compute {mk.dtype} weights")
    if s.mc % mk.mr or s.nc % mk.nr or s.mc <= 0 or s.nc <= 0 or s.kc <= 0:
        raise KernelError(f"slice {s} is not a whole number of {mk.mr}x{mk.nr} tiles")
    if mk.nr % mk.lanes:
        raise KernelError(f"NR={mk.nr} is not a multiple of {mk.lanes} lanes")
    if qtype(mk.dtype) is not None and s.kc % BLOCK:
        raise KernelError(f"KC={s.kc} is not a whole number of {BLOCK}-k blocks for {mk.name}")
    if ISAS[mk.isa].tile_rows and s.kc % ISAS[mk.isa].k_align:
        raise KernelError(f"KC={s.kc} is not a whole number of {ISAS[mk.isa].k_align}-pair AMX tiles")


def linear_source(shape: GemmShape, buckets: Sequence[Bucket], name: str = "linear",
                  epilogue: str | None = None) -> str:
    """TVMScript text of one dynamic-m kernel that dispatches on m over ``buckets``, fusing
    ``epilogue`` (default: the shape's).

    Parameters: ``A[m, k]``, the packed weight, ``R[m, n]`` (``residual``) or ``B[n]``
    (``bias``), then the output ``Y[m, n]`` (``Y[m, n / 2]`` for ``silu_mul``).
    """
    if not buckets:
        raise KernelError("a kernel needs at least one bucket")
    epilogue = shape.epilogue if epilogue is None else epilogue
    if epilogue not in EPILOGUES:
        raise KernelError(f"unknown epilogue {epilogue!r}; one of {EPILOGUES}")
    isa = ISAS[_layout_isa({b.schedule.mk.isa for b in buckets})]
    for b in buckets:
        check_schedule(shape, b.schedule)
    n, k, lanes = shape.n, shape.k, isa.lanes
    if epilogue == "silu_mul" and n % (2 * lanes):
        raise KernelError(f"silu_mul needs n = 2 x intermediate a multiple of {2 * lanes}, not {n}")
    n_out = n // 2 if epilogue == "silu_mul" else n
    layout = WeightLayout(isa.name, shape.dtype)
    panels, k_red, width = layout.shape(n, k)  # width: lanes, or a panel's bytes per block
    extra_param = {"residual": "var_R: T.handle, ",
                   "bias": f'B: T.Buffer(({n},), "float32"), '}.get(epilogue, "")
    extra_buffer = ""
    if epilogue == "residual":
        extra_buffer = f'\n        R = T.match_buffer(var_R, (m, {n}), "float32")'
    if layout.quant is not None:  # the blocks' fp16 d (and m) and, for q8_0, their int8 values
        layout.quant.check_k(k)
        view = "T.decl_buffer(({}, {}, {}), {!r}, data=Wp.data)"
        extra_buffer += (f"\n        Wh = {view.format(panels, k_red, width // 2, 'float16')}"
                         f"\n        Wi = {view.format(panels, k_red, width, 'int8')}"
                         f"\n        Ww = {view.format(panels, k_red, width // 4, 'int32')}")
    if any(_reads_pair_words(b.schedule, k) for b in buckets):  # A's fp32 pairs as uint64 words
        extra_buffer += f'\n        A2 = T.decl_buffer((m, {k // 2}), "uint64", data=A.data)'
    head = f'''
    @D.prim_func(s_tir=True)
    def {name}(var_A: T.handle, Wp: T.Buffer(({panels}, {k_red}, {width}), "{layout.storage}"),
             {extra_param}var_Y: T.handle):
        T.func_attr({{"global_symbol": "{name}", "tir.noalias": True, "tirx.is_scheduled": True}})
        m = T.int64()
        A = T.match_buffer(var_A, (m, {k}), "float32")
        Y = T.match_buffer(var_Y, (m, {n_out}), "float32"){extra_buffer}
        with T.sblock("root"):
    '''
    lines = textwrap.dedent(head).strip("\n").split("\n")
    base = 3
    # the dot-product instructions (and amxdq's bf16 pair conversion), inlined from LLVM IR
    # (see DPBF16_LL): one module of IR for the kernel
    ir = [DOT_LL[i] for i in sorted({b.schedule.mk.isa for b in buckets} & set(DOT_LL))]
    ir += [BF16_PAIRS_LL] if any(b.schedule.mk.isa == "amxdq" for b in buckets) else []
    if ir:
        lines.append(f"            with T.attr(0, \"pragma_import_llvm\", {''.join(ir)!r}):")
        base = 4
    ordered = sorted(buckets, key=lambda b: b.m_max)
    for i, b in enumerate(ordered):
        body = _variant(shape, b.schedule, i, epilogue)
        if len(ordered) == 1:
            lines += _indent(body, base)
            break
        if i == len(ordered) - 1:
            lines.append("    " * base + ("else:" if i else "if True:"))
        else:
            lines.append("    " * base + ("elif" if i else "if") + f" m <= T.int64({b.m_max}):")
        lines += _indent(body, base + 1)
    return "\n".join(lines) + "\n"


# The dot-product instructions take operands of types the wheel's TIR-to-LLVM code generator
# cannot emit or does not pair with the accumulator: ``<2L x bfloat>`` (bf16 is legalized to u16
# storage, and an unlegalized bf16 crashes it) and ``<4L x i8>``. The kernel passes them as
# 32-bit words and a function, linked into the module through TVM's ``pragma_import_llvm`` and
# inlined, reinterprets them (a no-op bitcast) for the ISA's instruction:
# - bf16 pairs, ``vdpbf16ps`` (16 lanes) or Arm's ``bfdot`` (4 lanes): per fp32 lane i,
#   acc[i] + a[2i] * b[2i] + a[2i + 1] * b[2i + 1];
# - int8 quads, ``vpdpbusd`` (AVX512-VNNI, and VEX-encoded AVX-VNNI in 8 lanes; unsigned a by
#   signed b) or Arm's ``sdot`` (signed by signed): per int32 lane i, acc[i] + the dot product
#   of the 4 bytes of a[i] and the 4 of b[i].
_DOT_TEMPLATE = """
define linkonce_odr <{L} x {T}> @{name}(<{L} x {T}> %acc, <{L} x i32> %a, <{L} x i32> %b) alwaysinline {{
  %ab = bitcast <{L} x i32> %a to <{N} x {E}>
  %bb = bitcast <{L} x i32> %b to <{N} x {E}>
  %r = call <{L} x {T}> @{intrinsic}(<{L} x {T}> %acc, <{N} x {E}> %ab, <{N} x {E}> %bb)
  ret <{L} x {T}> %r
}}
"""


def _dot_ll(intrinsic: str, names: tuple[str, ...], T: str, E: str, L: int, N: int) -> str:  # noqa: N803
    """The instruction declared once, and one function per name calling it."""
    fields = {"intrinsic": intrinsic, "T": T, "E": E, "L": L, "N": N}
    declare = f"\ndeclare <{L} x {T}> @{intrinsic}(<{L} x {T}>, <{N} x {E}>, <{N} x {E}>)"
    return declare + "".join(_DOT_TEMPLATE.format(name=name, **fields) for name in names)


DPBF16_LL = {isa: _dot_ll(intrinsic, ("sandwich_dpbf16ps",), T="float", E="bfloat", L=lanes, N=2 * lanes)
             for isa, lanes, intrinsic in (("avx512bf16", 16, "llvm.x86.avx512bf16.dpbf16ps.512"),
                                           ("neonbf16", 4, "llvm.aarch64.neon.bfdot.v4f32.v8bf16"))}
# ``sandwich_dot4`` multiplies the weight bytes as stored, ``sandwich_dot4u`` 4-bit values (0..15,
# unsigned everywhere); the two are one instruction where the unit has a dot product.
DOT4_LL = {isa: _dot_ll(intrinsic, ("sandwich_dot4", "sandwich_dot4u"), T="i32", E="i8", L=lanes, N=4 * lanes)
           for isa, lanes, intrinsic in (("avx512vnni", 16, "llvm.x86.avx512.vpdpbusd.512"),
                                         ("avxvnni", 8, "llvm.x86.avx512.vpdpbusd.256"),
                                         ("neondot", 4, "llvm.aarch64.neon.sdot.v4i32.v16i8"))}
# AVX2 without VNNI (avx2dot) has no 4-byte dot product; ``vpmaddubsw`` multiplies unsigned by
# signed bytes into saturating int16 pair sums and ``vpmaddwd`` by ones adds the pairs to int32, as
# llama.cpp's AVX2 kernels do. Signed weights (q8_0) go through |w| and the activation's sign
# flipped where w < 0 (``vpsignb``; AVX-512, which has none, negates under a mask: avx512dot), so
# no pair sum passes 2 x 128 x 127 and none saturates; 4-bit values (at most 2 x 15 x 127) need
# neither.
_MADD_TEMPLATE = """
define linkonce_odr <{L} x i32> @{name}(<{L} x i32> %acc, <{L} x i32> %w, <{L} x i32> %a) alwaysinline {{
  %wb = bitcast <{L} x i32> %w to <{B} x i8>
  %ab = bitcast <{L} x i32> %a to <{B} x i8>
{body}  %p = call <{H} x i16> @{maddubs}(<{B} x i8> %u, <{B} x i8> %s)
  %q = call <{L} x i32> @{maddwd}(<{H} x i16> %p, <{H} x i16> <{ones}>)
  %r = add <{L} x i32> %acc, %q
  ret <{L} x i32> %r
}}
"""
# ISA: its two multiply-adds, then how the activation takes w's sign (``%s``) and what that declares
_MADD = {
    "avx2dot": ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd", """\
  %s = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> %ab, <32 x i8> %wb)
""", "declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)\n"),
    "avx512dot": ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512", """\
  %neg = icmp slt <64 x i8> %wb, zeroinitializer
  %na = sub <64 x i8> zeroinitializer, %ab
  %s = select <64 x i1> %neg, <64 x i8> %na, <64 x i8> %ab
""", ""),
}


def _madd_ll(isa: str) -> str:
    """``sandwich_dot4`` (q8_0's signed values: |w| times the activation with w's sign) and
    ``sandwich_dot4u`` (4-bit values as they are) of an ISA without a dot product."""
    maddubs, maddwd, signed, sign_declare = _MADD[isa]
    lanes = ISAS[isa].lanes
    b, h = 4 * lanes, 2 * lanes
    fields = {"L": lanes, "B": b, "H": h, "maddubs": maddubs, "maddwd": maddwd,
              "ones": ", ".join(["i16 1"] * h)}
    declare = (f"\ndeclare <{h} x i16> @{maddubs}(<{b} x i8>, <{b} x i8>)"
               f"\ndeclare <{lanes} x i32> @{maddwd}(<{h} x i16>, <{h} x i16>)"
               f"\ndeclare <{b} x i8> @llvm.abs.v{b}i8(<{b} x i8>, i1)\n{sign_declare}")
    absolute = f"  %u = call <{b} x i8> @llvm.abs.v{b}i8(<{b} x i8> %wb, i1 false)\n"
    as_they_are = (f"  %u = bitcast <{b} x i8> %wb to <{b} x i8>\n"
                   f"  %s = bitcast <{b} x i8> %ab to <{b} x i8>\n")
    return declare + "".join(_MADD_TEMPLATE.format(name=name, body=body, **fields)
                             for name, body in (("sandwich_dot4", absolute + signed),
                                                ("sandwich_dot4u", as_they_are)))


DOT4_LL |= {isa: _madd_ll(isa) for isa in _MADD}
DOT_LL = {**DPBF16_LL, **DOT4_LL}

# Two fp32 vectors (k even, k odd of 16 columns) to 16 bf16 pairs, rounded to nearest even:
# ``vcvtne2ps2bf16`` puts its second operand's 16 values in the low half and the first's in the
# high half, and a word shuffle interleaves them (amxdq's dequantized weight slices).
BF16_PAIRS_LL = """
declare <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float>, <16 x float>)
define linkonce_odr <16 x i32> @sandwich_bf16_pairs(<16 x float> %lo, <16 x float> %hi) alwaysinline {
  %p = call <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float> %hi, <16 x float> %lo)
  %w = bitcast <32 x bfloat> %p to <32 x i16>
  %s = shufflevector <32 x i16> %w, <32 x i16> poison, <32 x i32> <""" + ", ".join(
    f"i32 {i // 2 + 16 * (i % 2)}" for i in range(32)) + """>
  %r = bitcast <32 x i16> %s to <16 x i32>
  ret <16 x i32> %r
}
"""


def _layout_isa(isas: set[str]) -> str:
    """The ISA whose weight layout the buckets read: theirs, or the one the others' extend (an
    AMX kernel's small-m buckets are avx512bf16 register tiles on the same packed weight)."""
    for isa in isas:
        if isas <= {isa, *ISAS[isa].extends}:
            return isa
    raise KernelError(f"buckets mix ISAs {sorted(isas)} that read different weight layouts")


def _indent(lines: list[str], level: int) -> list[str]:
    return ["    " * level + ln for ln in lines]


def _variant(shape: GemmShape, sch: GemmSchedule, v: int, epilogue: str = "none") -> list[str]:
    """The statements computing Y with one schedule (names suffixed by ``v``)."""
    n, k_full = shape.n, shape.k
    mk, s, p = sch.mk, sch.slice, sch.poly
    mr, nr, lanes = mk.mr, mk.nr, mk.lanes
    nv = nr // lanes
    pairs_k = mk.k_pack == 2  # k counts bf16 pairs (one vdpbf16ps each)
    tiles = ISAS[mk.isa].tile_rows > 0  # an AMX tile grid
    quant = qtype(mk.dtype)  # block-quantized weights (kernels.quant)
    int8 = ISAS[mk.isa].int8_dot  # ... times int8 activations (vpdpbusd)
    dq = tiles and quant is not None and not int8  # bf16 tiles on a dequantized slice (amxdq)
    tm, tn = mk.tiles
    # AMX walks the padded k (16 pairs per tile; A and W are zero there); amxdq k-pairs
    k = WeightLayout(mk.isa, mk.dtype).reduction(k_full) if tiles else cdiv(k_full, mk.k_pack)
    kc = min(s.kc, k)
    if dq:
        k, kc = k_full // 2, min(s.kc // 2, k_full // 2)
    mct, nct = s.mc // mr, s.nc // nr
    kb, ktail = cdiv(k, kc), k - (cdiv(k, kc) - 1) * kc
    nt, full_nt = cdiv(n, nr), n // nr
    nchunk = cdiv(nt, p.pn)
    kchunk = cdiv(kb, p.pk)
    threads = p.threads
    mt = f"((m + T.int64({mr - 1})) // T.int64({mr}))"
    mchunk = f"(({mt} + T.int64({p.pm - 1})) // T.int64({p.pm}))"
    a, b, c = f"(t // {p.pn * p.pk})", f"(t // {p.pk} % {p.pn})", f"(t % {p.pk})"
    it = f"({a} * {mchunk} + ic * {mct} + ir)"
    jt = f"({b} * {nchunk} + jc * {nct} + jr)"
    pc = f"({c} * {kchunk} + pcl)"
    ap, part = f"Ap{v}", f"P{v}"
    # silu_mul from the registers needs whole (gate, up) pairs per tile and no split-K; with
    # several KC blocks the partial sums wait in scratch G until the last block's store.
    pairs = epilogue == "silu_mul" and nv % 2 == 0 and p.pk == 1
    y = f"G{v}" if epilogue == "silu_mul" else "Y"
    scratch = epilogue == "silu_mul" and (not pairs or kchunk > 1)

    conds = [f"{it} < T.min({mt}, ({a} + 1) * {mchunk})", f"jc * {nct} + jr < {nchunk}"]
    if nchunk * p.pn != nt or nct * cdiv(nchunk, nct) != nchunk:
        conds.append(f"{jt} < {nt}")
    if kchunk * p.pk != kb:
        conds.append(f"{pc} < {kb}")

    out = [f'with T.sblock("v{v}"):']
    if tiles and int8:  # A in 16 x 32-byte int8 tiles, a block each: Ap[row tile, block, row, quad]
        out += [f'    {ap} = T.sblock_alloc_buffer(({mt} * {tm}, {k // BLOCK}, 16, 8), "int32")',
                f'    Ad{v} = T.sblock_alloc_buffer(({mt} * {tm}, {k // BLOCK}, 16), "float32")',
                f'    As{v} = T.sblock_alloc_buffer(({mt} * {tm}, {k // BLOCK}, 16), "float32")',
                f'    C{v} = T.sblock_alloc_buffer(({threads}, {mr}, {nr}), "float32")',
                f'    I{v} = T.sblock_alloc_buffer(({threads}, {mr}, {nr}), "int32")']
        if quant.bits == 4:  # a block's B tiles, unpacked to one byte a value
            out.append(f'    Bq{v} = T.sblock_alloc_buffer(({threads}, {tn}, 8, 16), "int32")')
    elif tiles:  # A in 16 x 32-bf16 tiles, 1 KB each: Ap[row tile, k tile, row, k]
        out.append(f'    {ap} = T.sblock_alloc_buffer(({mt} * {tm}, {k // 16}, 16, 32), "uint16")')
        out.append(f'    C{v} = T.sblock_alloc_buffer(({threads}, {mr}, {nr}), "float32")')
        if dq:  # each thread's KC x NC slice of the weight as bf16 pairs: Wb[t, panel, pair, lane]
            out.append(f'    Wb{v} = T.sblock_alloc_buffer(({threads}, {nct * nv}, {kc}, 16), "uint32")')
    elif int8:  # A as int8 quads, and per (row, block) its scale and scale x sum of values
        out += [f'    {ap} = T.sblock_alloc_buffer(({mt}, {k // 4}, {mr}), "int32")',
                f'    Ad{v} = T.sblock_alloc_buffer(({mt}, {k // BLOCK}, {mr}), "float32")',
                f'    As{v} = T.sblock_alloc_buffer(({mt}, {k // BLOCK}, {mr}), "float32")']
    else:
        a_dtype = "uint32" if pairs_k else "float32"
        out.append(f'    {ap} = T.sblock_alloc_buffer(({mt}, {k}, {mr}), "{a_dtype}")')
    if scratch:
        out.append(f'    {y} = T.sblock_alloc_buffer((m, {n}), "float32")')
    if p.pk > 1:
        out.append(f'    {part} = T.sblock_alloc_buffer(({p.pk - 1}, m, {n}), "float32")')
    if tiles:
        pack = _pack_a_int8(v, 16, k_full, tiles=True) if int8 else _pack_a_tiles(ap, k_full, k // 16)
        config = tile_config(shapes=int8_tile_shapes(tm, tn)) if int8 else tile_config(16, 64)
        out += [
            f"    for it in T.parallel({mt} * {tm}):",
            *_indent(pack, 2),
            f"    for t in T.parallel({threads}):",
            *_indent(config, 2),
        ]
    else:
        pack = _pack_a_int8(v, mr, k_full) if int8 else _pack_a_panel(ap, sch, k_full)
        out += [
            f"    for it in T.parallel({mt}):",
            *_indent(pack, 2),
            f"    for t in T.parallel({threads}):",
        ]
    out += [
        f"        for jc in range({cdiv(nchunk, nct)}):",
        f"            for pcl in range({kchunk}):",
        *(_indent(_dequant_slice(v, quant, mk, f"({b} * {nchunk} + jc * {nct} + jd)", pc, nct, nchunk,
                                 nt, kc, k, kb), 4) if dq else []),
        f"                for ic in range(({mchunk} + T.int64({mct - 1})) // T.int64({mct})):",
        f"                    for jr in range({nct}):",
        f"                        for ir in range({mct}):",
        f"                            if {' and '.join(conds)}:",
        '                                with T.sblock("tile"):',
    ]
    ku = mk.k_partials
    acc = _TileAcc(f"C{v}", mr, nr, lanes) if tiles else _Acc(ku, mr, nr, lanes)
    tile = acc.alloc()
    if pairs:
        tile.append(f'ep = T.sblock_alloc_buffer((2, {lanes}), "float32", scope="global")')
    if quant is not None and not tiles:  # the current block's d and offset per vector column
        tile.append(f'qs = T.sblock_alloc_buffer(({nv}, 2, {lanes}), "float32", scope="global")')
    if int8 and not tiles:  # the current block's int32 sums
        tile.append(f'isum = T.sblock_alloc_buffer(({mr}, {nr}), "int32", scope="global")')
    if not tiles:
        tile += [f"for u, ii in T.grid({ku}, {mr}):"]
        for var, width, _, elem in acc.columns("ii"):
            tile += [f"    for {var} in T.vectorized({width}):", f"        {elem('u')} = T.float32(0)"]

    def fma(kidx: str, u: str) -> list[str]:
        def column(q: str) -> list[str]:
            if pairs_k:  # 16 fp32 sums += the dot products of 16 (A pair, B pair)s
                cell = acc.ramp(u, "ii", q)
                return [f'{cell} = T.call_pure_extern("float32x{lanes}", "sandwich_dpbf16ps", {cell}, '
                        f"T.Broadcast({ap}[{it}, {kidx}, ii], {lanes}), "
                        f"Wp[{jt} * {nv} + {q}, {kidx}, T.ramp(0, 1, {lanes})])"]
            cell = acc.vec(u, "ii", q, "w")
            b = f"Wp[{jt} * {nv} + {q}, {kidx}, w]"
            if mk.dtype != "float32":  # widened as it is loaded
                b = f'T.Cast("float32", {b})'
            return [f"for w in T.vectorized({lanes}):",
                    f"    {cell} = {cell} + {ap}[{it}, {kidx}, ii] * {b}"]
        # A[ii] is broadcast once, then NR/lanes FMAs
        return [f"for ii in T.unroll({mr}):", *_indent(acc.vectors(nv, column), 1)]

    def qkloop(length: int) -> list[str]:
        """The k loop over quantized blocks: per block, each vector column's d (and its offset:
        m, or -8 d) to registers, then the values widened, scaled and FMA'd (q4: the low and
        the high nibble of one byte are elements j and j + 16)."""
        blk, head = f"({pc} * {kc // BLOCK} + kb)", 2 * quant.header * lanes

        def panel(q: str) -> str:
            return f"{jt} * {nv} + {q}"

        def scales(q: str) -> list[str]:
            out = [f"for w in T.vectorized({lanes}):",
                   f'    qs[{q}, 0, w] = T.Cast("float32", Wh[{panel(q)}, {blk}, w])']
            if quant.has_min:
                out.append(f'    qs[{q}, 1, w] = T.Cast("float32", Wh[{panel(q)}, {blk}, {lanes} + w])')
            elif quant.bits == 4:
                out.append(f"    qs[{q}, 1, w] = qs[{q}, 0, w] * T.float32(-8)")
            return out

        def column(q: str) -> list[str]:
            cell, j = acc.vec("u", "ii", q, "w"), f"kq * {ku} + u"
            kidx = f"{pc} * {kc} + kb * {BLOCK} + {j}"
            if quant.bits == 8:
                value = f'T.Cast("float32", Wi[{panel(q)}, {blk}, {head} + ({j}) * {lanes} + w])'
                return [f"for w in T.vectorized({lanes}):",
                        f"    {cell} = {cell} + {ap}[{it}, {kidx}, ii] * ({value} * qs[{q}, 0, w])"]
            byte = f"Wp[{panel(q)}, {blk}, {head} + ({j}) * {lanes} + w]"
            lo, hi = (f'(T.Cast("float32", {nib}) * qs[{q}, 0, w] + qs[{q}, 1, w])'
                      for nib in (f"{byte} & T.uint8(15)", f"{byte} >> T.uint8(4)"))
            return [f"for w in T.vectorized({lanes}):",
                    f"    {cell} = {cell} + {ap}[{it}, {kidx}, ii] * {lo}"
                    f" + {ap}[{it}, {kidx} + 16, ii] * {hi}"]

        steps = BLOCK if quant.bits == 8 else BLOCK // 2  # values (q8_0) or bytes (q4) per block
        return [f"for kb in range({length // BLOCK}):",
                *_indent(acc.vectors(nv, scales), 1),
                f"    for kq in range({steps // ku}):",
                f"        for u in T.unroll({ku}):",
                f"            for ii in T.unroll({mr}):",
                *_indent(acc.vectors(nv, column), 4)]

    def ikloop(length: int) -> list[str]:
        """The k loop of int8 dot products: per block, each column's d and offset to registers,
        the int32 sums of 4-k quads (vpdpbusd: unsigned weight bytes x signed activation
        bytes; q4: low nibbles are quad j, high nibbles quad j + 4), then into the fp32 tile as
        sum x d x d_A + offset x d_A x sum(A) (offset: m, or -8 d / -128 d for the values stored
        unsigned)."""
        blk, head = f"({pc} * {kc // BLOCK} + kb)", 2 * quant.header * lanes // 4

        def panel(q: str) -> str:
            return f"{jt} * {nv} + {q}"

        def scales(q: str) -> list[str]:
            off = _int8_offset(mk.isa, quant, f"qs[{q}, 0, w]", panel(q), blk, lanes)
            return [f"for w in T.vectorized({lanes}):",
                    f'    qs[{q}, 0, w] = T.Cast("float32", Wh[{panel(q)}, {blk}, w])',
                    f"    qs[{q}, 1, w] = {off}"]

        def zero(q: str) -> list[str]:
            return [f"for w in T.vectorized({lanes}):", f"    isum[ii, {q} * {lanes} + w] = 0"]

        def dot(q: str) -> list[str]:
            cell = f"isum[ii, T.ramp({q} * {lanes}, 1, {lanes})]"
            word = f"Ww[{panel(q)}, {blk}, T.ramp({head} + j * {lanes}, 1, {lanes})]"

            def step(w: str, quad: str, fn: str = "sandwich_dot4u") -> str:
                a = f"T.Broadcast({ap}[{it}, {blk} * 8 + {quad}, ii], {lanes})"
                return f'{cell} = T.call_pure_extern("int32x{lanes}", "{fn}", {cell}, {w}, {a})'

            if quant.bits == 8:
                return [step(word, "j", "sandwich_dot4")]
            mask = f"T.Broadcast(T.int32({0x0F0F0F0F}), {lanes})"
            return [step(f"{word} & {mask}", "j"),
                    step(f"T.shift_right({word}, T.Broadcast(T.int32(4), {lanes})) & {mask}", "j + 4")]

        def scale(q: str) -> list[str]:
            cell = acc.vec("0", "ii", q, "w")
            a = f"{{}}{v}[{it}, {blk}, ii]"
            return [f"for w in T.vectorized({lanes}):",
                    f'    {cell} = {cell} + T.Cast("float32", isum[ii, {q} * {lanes} + w]) * '
                    f"(qs[{q}, 0, w] * {a.format('Ad')}) + qs[{q}, 1, w] * {a.format('As')}"]

        return [f"for kb in range({length // BLOCK}):",
                *_indent(acc.vectors(nv, scales), 1),
                f"    for ii in T.unroll({mr}):", *_indent(acc.vectors(nv, zero), 2),
                f"    for j in T.unroll({quant.value_bytes // 4}):",
                f"        for ii in T.unroll({mr}):", *_indent(acc.vectors(nv, dot), 3),
                f"    for ii in T.unroll({mr}):", *_indent(acc.vectors(nv, scale), 2)]

    def amx_ikloop(length: int) -> list[str]:
        """The k loop of AMX-INT8 tiles, one 32-k block a step: (q4: each B tile's nibbles
        unpacked to bytes in this thread's ``Bq``), ``tdpbsud`` of every A and B tile into
        zeroed int32 tiles, stored to ``I`` and added into the fp32 tile ``C`` as
        sum x d x d_A + offset x d_A x sum(A), 16 lanes at a time."""
        blk, head = f"({pc} * {kc // BLOCK} + kb)", 2 * quant.header * lanes
        a_reg, b_reg = tm * tn, tm * tn + tm
        body = []
        if quant.bits == 4:
            mask = f"T.int32({0x0F0F0F0F})"
            for j in range(tn):
                word = f"Ww[{jt} * {nv} + {j}, {blk}, {head // 4} + j * {lanes} + w]"
                body += ["for j in T.unroll(4):", f"    for w in T.vectorized({lanes}):",
                         f"        Bq{v}[t, {j}, j, w] = {word} & {mask}",
                         f"        Bq{v}[t, {j}, j + 4, w] = T.shift_right({word}, T.int32(4)) & {mask}"]
        body += [amx("tilezero", c) for c in range(tm * tn)]
        body += [amx("tileloadd64", a_reg + i, f"T.address_of({ap}[{it} * {tm} + {i}, {blk}, 0, 0])",
                     "T.int64(32)") for i in range(tm)]
        b_tile = (f"Wi[{jt} * {nv} + {{j}}, {blk}, {head}]" if quant.bits == 8 else f"Bq{v}[t, {{j}}, 0, 0]")
        body += [amx("tileloadd64", b_reg + j, f"T.address_of({b_tile.format(j=j)})", "T.int64(64)")
                 for j in range(tn)]
        body += [amx("tdpbsud", i * tn + j, a_reg + i, b_reg + j) for i in range(tm) for j in range(tn)]
        body += [amx("tilestored64", i * tn + j, f"T.address_of(I{v}[t, {i * 16}, {j * 16}])",
                     f"T.int64({nr * 4})") for i in range(tm) for j in range(tn)]
        row = f"{it} * {tm} + ii // 16, {blk}, ii % 16"
        d = f'T.Cast("float32", Wh[{jt} * {nv} + q, {blk}, w])'
        body += [f"for ii in range({mr}):", f"    for q in T.unroll({tn}):",
                 f"        for w in T.vectorized({lanes}):",
                 f"            C{v}[t, ii, q * {lanes} + w] = C{v}[t, ii, q * {lanes} + w] + "
                 f'T.Cast("float32", I{v}[t, ii, q * {lanes} + w]) * ({d} * Ad{v}[{row}]) + '
                 f"{_int8_offset(mk.isa, quant, d, f'{jt} * {nv} + q', blk, lanes)} * As{v}[{row}]"]
        return [f"for kb in range({length // BLOCK}):", *_indent(body, 1)]

    def kloop(length: int) -> list[str]:
        if int8 and tiles:
            return amx_ikloop(length)
        if int8:
            return ikloop(length)
        if quant is not None and not tiles:
            return qkloop(length)
        if tiles:  # A tile (it, kb) and the B tile of 16 pairs of panel jt * tn + j, from kq
            def b_tile(j: int, q: str = "kq", r: int = 0) -> str:
                if dq:  # the slice's panel jr * tn + j
                    return f"Wb{v}[t, jr * {nv} + {j}, {q} * 16 + {r}, 0]"
                return f"Wp[{jt} * {nv} + {j}, {pc} * {kc} + {q} * 16 + {r}, 0]"

            return tile_kloop(tm, tn, length,
                              lambda i: f"{ap}[{it} * {tm} + {i}, {pc} * {kc // 16} + kq, 0, 0]", b_tile,
                              prefetch_b=not dq)
        lines = []
        if length // ku:
            lines += [f"for kq in range({length // ku}):", f"    for u in T.unroll({ku}):"]
            lines += _indent(fma(f"{pc} * {kc} + kq * {ku} + u", "u"), 2)
        if length % ku:
            lines += [f"for kr in range({length % ku}):"]
            lines += _indent(fma(f"{pc} * {kc} + {length - length % ku} + kr", "0"), 1)
        return lines

    if tiles and int8:  # the fp32 tile the blocks add into
        tile += [f"for ii in range({mr}):", f"    for jj in T.vectorized({nr}):",
                 f"        C{v}[t, ii, jj] = T.float32(0)"]
    elif tiles:
        tile += [amx("tilezero", c) for c in range(tm * tn)]
    if ktail == kc:
        tile += kloop(kc)
    else:
        tile += [f"if {pc} < {kb - 1}:"] + _indent(kloop(kc), 1) + ["else:"] + _indent(kloop(ktail), 1)
    if tiles and not int8:  # the accumulator tiles to this thread's C slot (row stride NR floats)
        tile += [amx("tilestored64", i * tn + j, f"T.address_of(C{v}[t, {i * 16}, {j * 16}])",
                      f"T.int64({nr * 4})") for i in range(tm) for j in range(tn)]

    def store(target: str) -> list[str]:
        """``target`` opens the subscript: ``Y[`` or ``P0[1, `` for split-K partials."""
        row = f"{it} * {mr} + ii"

        def body(vector: bool) -> list[str]:
            out = []
            for var, width, offset, elem in acc.columns("ii"):
                col = f"{jt} * {nr} + {offset}{var}"
                dst = f"{target}{row}, {col}]"
                loop = f"for {var} in T.vectorized({width}):" if vector else f"for {var} in range({width}):"
                guard = [] if vector else [f"if {col} < {n}:"]
                total = " + ".join(elem(u) for u in range(ku))
                rest = [loop] + _indent(guard + _indent([f"{dst} = {dst} + {total}"], len(guard)), 1)
                if target == "Y[":  # the first store of the output carries the epilogue
                    total += {"none": "", "residual": f" + R[{row}, {col}]", "bias": f" + B[{col}]"}[epilogue]
                first = [loop] + _indent(guard + _indent([f"{dst} = {total}"], len(guard)), 1)
                if kchunk == 1:
                    out += first
                else:
                    out += ["if pcl == 0:"] + _indent(first, 1) + ["else:"] + _indent(rest, 1)
            return out

        lines = [f"for ii in T.unroll({mr}):", f"    if {row} < m:"]
        if full_nt == nt:
            lines += _indent(body(True), 2)
        else:
            split = [f"if {jt} < {full_nt}:", *_indent(body(True), 1), "else:", *_indent(body(False), 1)]
            lines += _indent(split, 2)
        return lines

    def store_pairs() -> list[str]:
        """silu_mul from registers: vector pair q of the tile is (gate, up) of output block q."""
        half, row = nv // 2, f"{it} * {mr} + ii"

        def pair(q: str) -> list[str]:
            blk = f"({jt} * {half} + {q})"

            def total(off: int) -> str:
                vec = f"(2 * {q} + {off})" if not acc.split else str(2 * int(q) + off)
                prior = [f"{y}[{row}, {jt} * {nr} + {vec} * {lanes} + w]"] if kchunk > 1 else []
                return " + ".join([acc.vec(str(u), "ii", vec, "w") for u in range(ku)] + prior)

            # gate and up go through a 2-vector stack buffer first: silu_mul repeats its
            # arguments, and as plain loads LLVM keeps them in registers (repeated sums of heap
            # loads were re-evaluated).
            inner = [f"for w in T.vectorized({lanes}):", f"    ep[0, w] = {total(0)}",
                     f"    ep[1, w] = {total(1)}",
                     f"for w in T.vectorized({lanes}):",
                     f"    Y[{row}, {blk} * {lanes} + w] = {silu_mul('ep[0, w]', 'ep[1, w]')}"]
            guard = [] if full_nt == nt else [f"if {blk} * {lanes} < {n // 2}:"]
            return guard + _indent(inner, len(guard))

        return [f"for ii in T.unroll({mr}):", f"    if {row} < m:", *_indent(acc.vectors(half, pair), 2)]

    if pairs and kchunk == 1:
        tile += store_pairs()
    elif pairs:
        tile += [f"if pcl < {kchunk - 1}:", *_indent(store(f"{y}["), 1), "else:", *_indent(store_pairs(), 1)]
    elif p.pk == 1:
        tile += store(f"{y}[")
    else:
        tile += [f"if {c} == 0:"] + _indent(store(f"{y}["), 1)
        for cc in range(1, p.pk):
            tile += [f"elif {c} == {cc}:"] + _indent(store(f"{part}[{cc - 1}, "), 1)
    out += _indent(tile, 9)
    if tiles:  # give the tile state back (a thread without it saves and restores less)
        out += ["        " + amx("tilerelease")]

    # split-K thread c >= 1 wrote its partial to P[c - 1] when it had a KC block (c x kchunk <
    # kb: more threads than blocks leave the last ones none, and their P unwritten)
    summed = [cc for cc in range(1, p.pk) if cc * kchunk < kb]
    if summed:
        nch = cdiv(n, threads)
        parts = " + ".join(f"{part}[{cc - 1}, i, t * {nch} + j]" for cc in summed)
        out += [
            f"    for t in T.parallel({threads}):",
            "        for i in range(m):",
            f"            for j in range({nch}):",
            f"                if t * {nch} + j < {n}:",
            f"                    {y}[i, t * {nch} + j] = {y}[i, t * {nch} + j] + {parts}",
        ]
    if pairs and scratch:
        # G is touched only inside the tile block; TVM would allocate it there (the accesses'
        # lowest common ancestor), fresh for every tile. This never-taken store keeps it here.
        out += ["    if m < T.int64(0):", f"        {y}[0, 0] = T.float32(0)"]
    if epilogue == "silu_mul" and not pairs:  # silu_mul over the scratch GEMM, block by block
        blocks = n // 2 // lanes
        bch = cdiv(blocks, threads)
        jb = f"(t * {bch} + jb)"
        out += [
            f"    for t in T.parallel({threads}):",
            "        for i in range(m):",
            f"            for jb in range({bch}):",
            f"                if {jb} < {blocks}:",
            '                    with T.sblock("epilogue"):',
            f'                        ep = T.sblock_alloc_buffer((2, {lanes}), "float32", scope="global")',
            f"                        for w in T.vectorized({lanes}):",
            f"                            ep[0, w] = {y}[i, 2 * {jb} * {lanes} + w]",
            f"                            ep[1, w] = {y}[i, (2 * {jb} + 1) * {lanes} + w]",
            f"                        for w in T.vectorized({lanes}):",
            f"                            Y[i, {jb} * {lanes} + w] = {silu_mul('ep[0, w]', 'ep[1, w]')}",
        ]
    return out


def _a_value(mr: int, k: int, col: str, guard: bool) -> str:
    """``A[it * mr + ii, col]`` as fp32 text: zero past m, and past k with ``guard``."""
    row = f"it * {mr} + ii"
    cond = f"{row} < m" + (f" and {col} < {k}" if guard else "")
    col_in = f"T.min({col}, {k - 1})" if guard else col
    return f"T.if_then_else({cond}, A[T.min({row}, m - T.int64(1)), {col_in}], T.float32(0))"


def _pack_a(mr: int, k: int, pairs: bool, kk: str = "kk") -> str:
    """The packed A panel's element ``[it, kk, ii]``: A's value; with ``pairs`` the bf16 pair
    (A[., 2kk], A[., 2kk + 1]) in one word (the second zero past an odd k)."""
    if not pairs:
        return _a_value(mr, k, kk, False)
    lo, hi = (bf16_bits(_a_value(mr, k, f"2 * {kk} + {i}", i == 1 and k % 2 == 1)) for i in (0, 1))
    return f"{lo} | ({hi} << T.uint32(16))"


def _reads_pair_words(sch: GemmSchedule, k: int) -> bool:
    """Whether the schedule's A pack reads A's fp32 pairs as 8-byte words (``A2``): a bf16
    pair register tile on an even k (an odd k leaves the rows of A unaligned to 8 bytes)."""
    return sch.mk.k_pack == 2 and not ISAS[sch.mk.isa].tile_rows and k % 2 == 0


def _pack_a_panel(ap: str, sch: GemmSchedule, k: int) -> list[str]:
    """Row panel ``it`` of A, ``Ap[it, kk, ii]`` (kk in bf16 pairs for a pair tile), packed
    ``lanes`` consecutive kk of one row at a time: each row is read contiguously (pairs as one
    8-byte word each, see ``_reads_pair_words``) and the stores of a block stay within
    MR x lanes words. Element by element (kk, then the MR rows, scalar rounding), the pack
    held down_proj at m = 512 to 0.84x torch bf16 on a Zen 5, its time depending on A's
    address. The last k % lanes are packed element by element."""
    mr, lanes, pairs = sch.mk.mr, sch.mk.lanes, sch.mk.k_pack == 2
    kp = cdiv(k, sch.mk.k_pack)
    blocks = kp // lanes if not pairs or _reads_pair_words(sch, k) else 0
    row, col = f"it * {mr} + ii", f"kb * {lanes} + j"
    out = []
    if blocks:
        src = f"{'A2' if pairs else 'A'}[T.min({row}, m - T.int64(1)), {col}]"
        value, zero = (bf16_pair_of_word(src), "T.uint32(0)") if pairs else (src, "T.float32(0)")
        out += [f"for kb in range({blocks}):", f"    for ii in T.unroll({mr}):",
                f"        for j in T.vectorized({lanes}):",
                f"            {ap}[it, {col}, ii] = T.if_then_else({row} < m, {value}, {zero})"]
    if blocks * lanes < kp:
        kk = f"({blocks * lanes} + kk)"
        out += [f"for kk, ii in T.grid({kp - blocks * lanes}, {mr}):",
                f"    {ap}[it, {kk}, ii] = {_pack_a(mr, k, pairs, kk)}"]
    return out


def _int8_offset(isa: str, quant, d: str, panel: str, blk: str, lanes: int) -> str:
    """A block's offset per weight column for the int8 dot products (TIR text, lane ``w``): q4_1's
    minimum m, q4_0's -8 d, and q8_0's -128 d where its values are stored unsigned (none where
    the dot product is signed by signed)."""
    if quant.has_min:
        return f'T.Cast("float32", Wh[{panel}, {blk}, {lanes} + w])'
    if quant.bits == 8 and ISAS[isa].signed_dot:
        return "T.float32(0)"
    return f"{d} * T.float32({-(1 << (quant.bits - 1))})"


def _dequant_slice(v: int, quant, mk, jt: str, pc: str, nct: int, nchunk: int, nt: int, kc: int,
                   k: int, kb: int) -> list[str]:
    """This thread's KC x NC slice of a quantized weight (the avx512vnni layout) as bf16 pairs
    ``Wb[t, slice panel, pair, lane]`` for amxdq's tiles: per panel and block, d and the offset
    to registers, then for every pair of k the two values out of their quad words (q8_0 bytes
    stored + 128; a q4 word's low nibbles are quad j, its high ones quad j + 4), scaled and
    rounded to bf16. ``jt`` is the tile index with the slice's ``jd``; ``kc``, ``k`` in pairs."""
    head = 2 * quant.header * 16
    blk, panel = f"({pc} * {kc // 16} + bb)", f"{jt} * {mk.nr // 16} + j"
    off = _int8_offset(mk.isa, quant, "qd[0, w]", panel, blk, 16)

    def value(e: int) -> str:  # 16 lanes of element 2p + e of the block
        quad, byte = "(p // 2)", f"(2 * (p % 2) + {e})"
        if quant.bits == 8:
            word, bits, mask = f"{quad} * 16", f"8 * {byte}", 255
        else:
            word, bits, mask = f"{quad} % 4 * 16", f"8 * {byte} + 4 * ({quad} // 4)", 15
        lanes = "T.ramp(0, 1, 16)"
        q = (f"(T.shift_right(Ww[{panel}, {blk}, {head // 4} + {word} + {lanes}], T.Broadcast({bits}, 16))"
             f" & T.Broadcast(T.int32({mask}), 16))")
        return f'T.Cast("float32x16", {q}) * qd[0, {lanes}] + qd[1, {lanes}]'

    return [
        f"for jd in range({nct}):",
        f"    if {jt} < {nt} and jc * {nct} + jd < {nchunk} and {pc} < {kb}:",
        f"        for j, bb in T.grid({mk.nr // 16}, {kc // 16}):",
        f"            if {pc} * {kc} + bb * 16 < {k}:",
        '                with T.sblock("dequant"):',
        '                    qd = T.sblock_alloc_buffer((2, 16), "float32", scope="global")',
        "                    for w in T.vectorized(16):",
        f'                        qd[0, w] = T.Cast("float32", Wh[{panel}, {blk}, w])',
        f"                        qd[1, w] = {off}",
        "                    for p in T.unroll(16):",
        f"                        Wb{v}[t, jd * {mk.nr // 16} + j, bb * 16 + p, T.ramp(0, 1, 16)] = "
        f'T.call_pure_extern("uint32x16", "sandwich_bf16_pairs", {value(0)}, {value(1)})',
    ]


def _pack_a_int8(v: int, mr: int, k: int, tiles: bool = False) -> list[str]:
    """Row panel ``it`` of A quantized per row and block of 32 (llama.cpp's q8_0 activations):
    d = max |a| / 127, q = round(a / d) as int8 quads ``Ap[it, k / 4, ii]`` (``tiles``: a block's
    8 quads of a row side by side, ``Ap[it, block, ii, quad]``, the rows of an AMX A tile), with
    ``Ad[it, block, ii] = d`` and ``As[it, block, ii] = d x sum(q)``; rows past m are zero."""
    row = f"it * {mr} + ii"
    dst = f"Ap{v}[it, b, ii, j]" if tiles else f"Ap{v}[it, b * 8 + j, ii]"
    quad = " | ".join(f'((T.Cast("int32", qa[4 * j + {b}]) & 255) << {8 * b})' for b in range(4))
    return [
        f"for b, ii in T.grid({k // BLOCK}, {mr}):",
        '    with T.sblock("quantize_a"):',
        f'        qa = T.sblock_alloc_buffer(({BLOCK},), "float32", scope="global")',
        '        st = T.sblock_alloc_buffer((2,), "float32", scope="global")',
        '        tr = T.sblock_alloc_buffer((16,), "float32", scope="global")',
        f"        for c in T.vectorized({BLOCK}):",
        f"            qa[c] = T.if_then_else({row} < m, A[T.min({row}, m - T.int64(1)), b * {BLOCK} + c], "
        "T.float32(0))",
        *_tree("T.max(T.max(qa[c], T.float32(0) - qa[c]), T.max(qa[c + 16], T.float32(0) - qa[c + 16]))",
               "T.max", "st[0]"),
        "        st[1] = T.if_then_else(st[0] > T.float32(0), T.float32(127) / st[0], T.float32(0))",
        f"        for c in T.vectorized({BLOCK}):",
        "            qa[c] = T.round(qa[c] * st[1])",
        f"        Ad{v}[it, b, ii] = st[0] / T.float32(127)",
        *_tree("qa[c] + qa[c + 16]", "", "st[1]"),
        f"        As{v}[it, b, ii] = Ad{v}[it, b, ii] * st[1]",
        "        for j in range(8):",
        f"            {dst} = {quad}",
    ]


def _tree(first: str, op: str, into: str) -> list[str]:
    """A 32-wide reduction as halving vector steps (``tr``: 16, 8, 4, 2 lanes, then a scalar),
    where a scalar loop would cost a dependent operation per element; ``first`` combines
    element c with c + 16, ``op`` is ``T.max`` or "" for a sum."""
    def comb(a: str, b: str) -> str:
        return f"{op}({a}, {b})" if op else f"{a} + {b}"

    out = ["        for c in T.vectorized(16):", f"            tr[c] = {first}"]
    for width in (8, 4, 2):
        out += [f"        for c in T.vectorized({width}):",
                f"            tr[c] = {comb('tr[c]', f'tr[c + {width}]')}"]
    return out + [f"        {into} = {comb('tr[0]', 'tr[1]')}"]


def _pack_a_tiles(ap: str, k: int, blocks: int) -> list[str]:
    """Row tile ``it`` of A as bf16 AMX tiles: 32 consecutive k per tile row, so a row is one
    contiguous fp32 load rounded to 16-bit words (vectorized); the k tiles past k's last whole
    32 are zero-padded value by value."""
    def value(col: str, guard: bool) -> str:
        return f'T.Cast("uint16", {bf16_bits(_a_value(16, k, col, guard))})'

    out = []
    if k // 32:
        out += [f"for kb, ii in T.grid({k // 32}, 16):", "    for c in T.vectorized(32):",
                f"        {ap}[it, kb, ii, c] = {value('kb * 32 + c', False)}"]
    if blocks > k // 32:
        out += [f"for kb, ii, c in T.grid({blocks - k // 32}, 16, 32):",
                f"    {ap}[it, {k // 32} + kb, ii, c] = {value(f'({k // 32} + kb) * 32 + c', True)}"]
    return out


def linear_primfunc(shape: GemmShape, buckets: Sequence[Bucket], name: str = "linear",
                    epilogue: str | None = None, check_well_formed: bool = True,
                    reuse: bool = True) -> tvm.tirx.PrimFunc:
    """Parse the generated kernel into a PrimFunc (the one parsed before from the same source,
    unless ``reuse`` is off: ``parse_tvmscript``)."""
    src = linear_source(shape, buckets, name, epilogue)
    try:
        return parse_tvmscript(src, check_well_formed, reuse)
    except Exception as err:  # the generator's bug, not the user's: keep the source for the report
        raise KernelError(f"generated TVMScript for {shape.name} does not parse: {err}\n{src}") from err


def fuses_silu_mul(intermediate: int, isa: str) -> bool:
    """Whether the MLP's gate_up weight is interleaved and runs the ``silu_mul`` epilogue."""
    return intermediate % ISAS[isa].lanes == 0


def pack_weight(w, isa: str, out=None, dtype: str = "float32"):
    """``W[n, k]`` -> ``Wp[panels, k / k_pack, lanes]`` (numpy) for ``isa``'s ``dtype`` kernels."""
    return WeightLayout(isa, dtype).pack(w, out)
