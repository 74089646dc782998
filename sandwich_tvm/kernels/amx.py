"""AMX micro-kernel pieces: the TensorIR text of the tile instructions a ``gemm_bf16_amx_*``
kernel is made of (``codegen`` places them in its loop nest).

AMX has eight tile registers, configured per thread by ``ldtilecfg`` (here: every tile 16 rows
x 64 bytes). ``tdpbf16ps C, A, B`` adds A (16 rows x 32 bf16 along k) times B (16 k-pair rows x
16 columns, each a bf16 pair) into C (16 x 16 fp32). The instructions are LLVM's tile-number
intrinsics (``llvm.x86.tileloadd64`` ...: tile registers are immediates), called through
``T.call_llvm_intrin``; the target must carry ``+amx-tile,+amx-bf16`` (``host_target`` adds
them from the CPU flags) and the process must hold the kernel's permission
(``host.enable_amx``).

AMX-INT8 (``gemm_q*_amxint8_*``): ``tdpbsud C, A, B`` adds A (16 rows x 32 signed bytes: one
32-k block of int8 activations) times B (8 k-quad rows x 16 columns of 4 unsigned weight bytes:
the block's ``avx512vnni`` quads) into C (16 x 16 int32); the A tiles are 16 x 32 bytes, the B
tiles 8 x 64 (``int8_tile_shapes``).
"""

from __future__ import annotations

from collections.abc import Callable

TILE_ROWS = 16  # rows of every tile
TILE_BYTES = 64  # bytes per tile row: 16 fp32, or 16 bf16 pairs
PAIRS = 16  # k-pairs one tdpbf16ps reduces (32 bf16)
# k steps ahead the B tiles are prefetched into L1, by grids of at least PREFETCH_ROWS row
# tiles (2 x tn tile products a step hide the 16 x tn prefetches; one row of tiles runs
# smaller m, where the prefetches cost more than they save). bench gemm, weights from memory,
# Xeon, 2 threads, 0 -> 4 steps: down_proj 1976 -> 2238 GFLOPS at m = 512 (32x32 tiles) but
# 1194 -> 996 at m = 64 (16x48); steps 2 / 8 / 16 ran slower than 4 with hot weights.
PREFETCH = 4
PREFETCH_ROWS = 2


def amx(intrinsic: str, *args: object) -> str:
    """One AMX instruction as a TIR statement (ints are tile registers: ``T.uint8`` immediates)."""
    text = ", ".join(f"T.uint8({a})" if isinstance(a, int) else str(a) for a in args)
    return f'T.evaluate(T.call_llvm_intrin("void", "llvm.x86.{intrinsic}"{", " if text else ""}{text}))'


def tile_config(rows: int = TILE_ROWS, colsb: int = TILE_BYTES,
                shapes: list[tuple[int, int]] | None = None) -> list[str]:
    """Load the tile configuration (palette 1; all eight tiles ``rows`` x ``colsb`` bytes, or
    tile r ``shapes[r]``) for this thread: tile state is per thread, so each parallel task loads
    it before its first tile."""
    shapes = shapes or [(rows, colsb)] * 8
    return ['with T.sblock("amx_config"):',
            '    cfg = T.sblock_alloc_buffer((64,), "uint8", scope="global")',
            "    for i in range(64):",
            "        cfg[i] = T.uint8(0)",
            "    cfg[0] = T.uint8(1)",
            *[line for r, (rw, cb) in enumerate(shapes)
              for line in (f"    cfg[{16 + 2 * r}] = T.uint8({cb})", f"    cfg[{48 + r}] = T.uint8({rw})")],
            "    " + amx("ldtilecfg", "T.address_of(cfg[0])")]


def prefetch(element: str) -> str:
    """Prefetch the cache line of a buffer element into L1 (``prefetcht0``)."""
    return (f'T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of({element}), '
            "T.int32(0), T.int32(3), T.int32(1)))")


def tile_kloop(tm: int, tn: int, pairs: int, a_tile: Callable[[int], str],
               b_tile: Callable[..., str], prefetch_b: bool = True) -> list[str]:
    """The k loop of a tm x tn tile grid over ``pairs`` k-pairs (a multiple of 16): per step
    ``kq``, load A tiles ``a_tile(i)`` and B tiles ``b_tile(j)`` (buffer elements, 64-byte rows;
    ``b_tile(j, step, row)``: row ``row`` of the tile at k step ``step``) and add every product.
    Registers: accumulators 0 .. tm*tn - 1, then the A tiles, then B."""
    a_reg, b_reg = tm * tn, tm * tn + tm
    body = [amx("tileloadd64", a_reg + i, f"T.address_of({a_tile(i)})", f"T.int64({TILE_BYTES})")
            for i in range(tm)]
    body += [amx("tileloadd64", b_reg + j, f"T.address_of({b_tile(j)})", f"T.int64({TILE_BYTES})")
             for j in range(tn)]
    body += [amx("tdpbf16ps", i * tn + j, a_reg + i, b_reg + j) for i in range(tm) for j in range(tn)]
    if prefetch_b and tm >= PREFETCH_ROWS:  # the B tiles PREFETCH steps ahead, a cache line per tile row
        body += [prefetch(b_tile(j, f"(kq + {PREFETCH})", r)) for j in range(tn) for r in range(TILE_ROWS)]
    return [f"for kq in range({pairs // PAIRS}):", *["    " + line for line in body]]


def int8_tile_shapes(tm: int, tn: int) -> list[tuple[int, int]]:
    """(rows, bytes per row) of each tile register of a tm x tn int8 grid: the int32
    accumulators, then the A tiles (16 x 32 bytes), then the B tiles (8 quads x 64 bytes)."""
    return [(TILE_ROWS, TILE_BYTES)] * (tm * tn) + [(TILE_ROWS, 32)] * tm + [(8, TILE_BYTES)] * tn
