"""Check (and time) kernels on a CPU that has no TVM compiler: build here, run there.

The micro-kernels of every ISA are built and inspected on any machine (the tests do), but an
ISA this CPU lacks (AMX-INT8, AVX-VNNI on an AMD host, every Arm ISA on x86) can only be *run*
where it exists, and such a machine may hold no more than Python, numpy and TVM's runtime. So:

- ``python -m sandwich_tvm.bench crosscheck build --isas amxint8,avxvnni --out DIR`` builds, for
  each (ISA, weight type it computes), the kernels of the unit tests (every m from 1 to 300 over
  odd n and k, tails, split-K, the residual and silu_mul epilogues) and the default kernels of
  Llama-3.2-1B shapes, each as a shared library, with the packed weights and the inputs, into
  ``DIR`` (a manifest, ``.so`` files and ``.npz`` data). Kernels of another architecture (Arm
  on an x86 host) are linked by ``zig cc`` (the ``ziglang`` wheel) where it is installed;
- ``python -m sandwich_tvm.bench.crosscheck run DIR --json OUT`` on the target (numpy and TVM's
  runtime only: ``TVM_USE_RUNTIME_LIB=1`` works) runs each kernel against numpy, with A
  quantized the way the int8 kernels quantize it, times the Llama shapes' kernels of each ISA
  in interleaved rounds, and writes what it found, naming the CPU. It exits 1 if any check
  fails; an ISA the CPU cannot run is reported as skipped, with the reason. The target may be
  emulated (``scripts/arm_env.py``'s ``.arm64/python`` on an x86 host): the report says so, and
  such a bundle is built with ``--no-timing``.

The run side imports nothing but numpy, TVM and ``sandwich_tvm.host``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

FORMAT = 2
CHECK_M = (1, 2, 3, 4, 5, 6, 7, 8, 17, 40, 41, 64, 127, 300)
TIME_M = (1, 16, 64, 128, 256, 512)
# Llama-3.2-1B's q/o projection and its up projection (n, k)
TIME_SHAPES = ((2048, 2048), (8192, 2048))


def quantized_a(a: np.ndarray) -> np.ndarray:
    """A as the int8 kernels see it: per row and block of 32, d = max |a| / 127,
    q = round(a x 127 / max |a|), dequantized."""
    blocks = a.reshape(a.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.round(blocks * inv) * (amax / np.float32(127))).reshape(a.shape)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 (to nearest even) and back, as the tile kernels pack them."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(
        np.float32)


def product_as_seen(a: np.ndarray, w: np.ndarray, mode: str) -> np.ndarray:
    """``A @ W.T`` as a kernel computes it: ``int8`` quantizes A per row and block, ``bf16``
    rounds both operands to bf16 (amxdq's tiles), ``float32`` takes them as they are."""
    if mode == "int8":
        return quantized_a(a) @ w.T
    if mode == "bf16":
        return bf16_rounded(a) @ bf16_rounded(w).T
    return a @ w.T


def operand_mode(isa: str) -> str:
    """What the micro-kernels of ``isa`` multiply quantized weights by (``product_as_seen``)."""
    from ..kernels.microkernel import ISAS

    spec = ISAS[isa]
    return "int8" if spec.int8_dot else "bf16" if spec.tile_rows or spec.k_pack == 2 else "float32"


def modes_by_m(buckets) -> list[tuple[int, str]]:
    """``(m_max, operand mode)`` of each bucket, in order."""
    return [(b.m_max, operand_mode(b.schedule.mk.isa)) for b in buckets]


def mode_at(modes: list, m: int) -> str:
    return next(mode for top, mode in modes if m <= top)


# --- build (needs TVM's compiler) -----------------------------------------------------------

def _weight(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[: n // 3] *= 0.01  # rows of small and large scales
    w[:, :32] += 0.5  # a block with an offset (q4_1's minimum)
    return w


def check_buckets(isa: str, dtype: str):
    """The unit test's buckets: a 1-row tile, split-K with threads left without a KC block, a
    2-row tile, split-K, and a large tile with a tail KC block (AMX tiles where the ISA has them)."""
    from ..kernels.codegen import Bucket
    from ..kernels.microkernel import ISAS, MicroKernel
    from ..kernels.schedule import GemmSchedule, Polymerization, Slice

    spec = ISAS[isa]
    small = spec.extends[0] if spec.extends else isa

    def sch(own, mr, vectors, mc, ncv, kc, pm=1, pn=2, pk=1):
        lanes = ISAS[own].lanes
        return GemmSchedule(MicroKernel(own, mr, vectors * lanes, dtype), Slice(mc, ncv * lanes, kc),
                            Polymerization(pm, pn, pk))

    big = (sch(isa, 32, 2, 64, 4, 96, pm=2, pn=1) if spec.tile_rows
           else sch(isa, 6, 1, 12, 4, 96, pm=2, pn=1))
    mid = (sch(isa, 16, 3, 32, 6, 64, pm=1, pn=1, pk=2) if spec.tile_rows
           else sch(isa, 4, 2, 8, 4, 64, pm=1, pn=1, pk=2))
    # m = 2, 3: split-K over 4 threads and one KC block (k <= 256): three threads have none
    idle = sch(small, 1, 2, 2, 4, 256, pm=1, pn=1, pk=4)
    return [Bucket(1, sch(small, 1, 2, 1, 4, 64)), Bucket(3, idle),
            Bucket(5, sch(small, 2, 3, 4, 6, 32, pm=2, pn=1)), Bucket(40, mid), Bucket(1 << 62, big)]


def _linker(target):
    """``tvm_compat.linker_for``, its error a one-line exit."""
    from ..host import HostError
    from ..tvm_compat import linker_for

    try:
        return linker_for(target)
    except HostError as err:
        raise SystemExit(f"error: {err}") from err


def storable(wp: np.ndarray) -> np.ndarray:
    """An array as ``np.savez`` keeps it: bf16 (ml_dtypes, which .npz loses) as its bits."""
    return wp.view(np.uint16) if wp.dtype.name == "bfloat16" else wp


def restored(data, name: str, dtype: str) -> np.ndarray:
    """The array ``storable`` kept, in the dtype the kernel reads."""
    wp = data[name]
    if dtype == "bfloat16" and wp.dtype == np.uint16:  # (bf16 pairs are packed as uint32)
        import ml_dtypes  # TVM's own dependency

        return wp.view(ml_dtypes.bfloat16)
    return wp


def _export(func, target, path: Path, linker=None) -> None:
    from ..tvm_compat import tvm

    tvm.compile(tvm.IRModule({"linear": func}), target=target).export_library(str(path), fcompile=linker)


def build(isas: list[str], out: Path, dtypes: list[str],
          time_shapes: tuple[tuple[int, int], ...] = TIME_SHAPES) -> dict:
    """Build every case (and the default kernels of ``time_shapes`` to time) into ``out``;
    returns the manifest. Each ISA builds the types of ``dtypes`` it computes."""
    from ..kernels.codegen import linear_primfunc
    from ..kernels.defaults import default_buckets
    from ..kernels.microkernel import ISAS
    from ..kernels.packing import WeightLayout
    from ..kernels.quant import QTYPES
    from ..kernels.schedule import GemmShape
    from ..tvm_compat import isa_target

    plan = []
    for isa in isas:
        if isa not in ISAS:
            raise SystemExit(f"error: {isa!r} is not a micro-kernel ISA; one of {', '.join(ISAS)}")
        own = [d for d in dtypes if d in ISAS[isa].dtypes]
        if not own:
            raise SystemExit(f"error: {isa} computes none of {', '.join(dtypes)}; it computes "
                             f"{', '.join(ISAS[isa].dtypes)}")
        target = isa_target(isa, 2)
        plan.append((isa, own, target, _linker(target)))  # refused before anything is built
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    k_quant, k_float, k_silu = 160, 101, 96  # 5 blocks of 32 (a KC tail); odd (a half bf16 pair)
    data = {f"a{k}_{m}": rng.standard_normal((m, k)).astype(np.float32)
            for k in (k_quant, k_float) for m in CHECK_M}
    data.update({f"s{m}": rng.standard_normal((m, k_silu)).astype(np.float32) for m in (1, 3, 33, 200)})
    cases, timings = [], []
    for isa, own, target, linker in plan:
        lanes = ISAS[isa].lanes
        for dtype in own:
            n, k = 6 * lanes + 5, k_quant if dtype in QTYPES else k_float
            layout = WeightLayout(isa, dtype)
            wp = layout.pack(_weight(n, k, 1))
            name = f"{isa}_{dtype}"
            data[f"{name}_wp"], data[f"{name}_w"] = storable(wp), layout.unpack(wp, n, k)
            data[f"{name}_r"] = rng.standard_normal((max(CHECK_M), n)).astype(np.float32)
            for epilogue in ("none", "residual"):
                buckets = check_buckets(isa, dtype)  # (the generator's tests check well-formedness)
                func = linear_primfunc(GemmShape(n, k, dtype, epilogue), buckets, check_well_formed=False)
                _export(func, target, out / f"{name}_{epilogue}.so", linker)
                cases.append({"isa": isa, "dtype": dtype, "epilogue": epilogue, "n": n, "k": k,
                              "lib": f"{name}_{epilogue}.so", "weight": name,
                              "modes": modes_by_m(buckets)})
            n2 = 2 * 3 * lanes
            shape = GemmShape(n2, k_silu, dtype, "silu_mul")
            silu = WeightLayout(isa, dtype, interleave=True)
            wp2 = silu.pack(_weight(n2, k_silu, 3))
            data[f"{name}_silu_wp"], data[f"{name}_silu_w"] = storable(wp2), silu.unpack(wp2, n2, k_silu)
            buckets = default_buckets(shape, 2, None, isa)
            func = linear_primfunc(shape, buckets, check_well_formed=False)
            _export(func, target, out / f"{name}_silu_mul.so", linker)
            cases.append({"isa": isa, "dtype": dtype, "epilogue": "silu_mul", "n": n2, "k": k_silu,
                          "lib": f"{name}_silu_mul.so", "weight": f"{name}_silu",
                          "modes": modes_by_m(buckets)})
            for tn, tk in time_shapes if layout.quant is not None else ():
                shape = GemmShape(tn, tk, dtype)
                lib = f"time_{name}_{tn}x{tk}.so"
                _export(linear_primfunc(shape, default_buckets(shape, 2, None, isa)), target, out / lib,
                        linker)
                timings.append({"isa": isa, "dtype": dtype, "n": tn, "k": tk, "lib": lib,
                                "packed": list(WeightLayout(isa, dtype).shape(tn, tk)),
                                "head": 2 * layout.quant.header * lanes})
            print(f"built {isa} {dtype}", flush=True)
    np.savez(out / "data.npz", **data)
    manifest = {"format": FORMAT, "check_m": list(CHECK_M), "time_m": list(TIME_M),
                "cases": cases, "timings": timings}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


# --- run (numpy and TVM's runtime) ----------------------------------------------------------

def _check(fn, case: dict, data, tvm) -> dict:
    dev = tvm.cpu()
    wp = tvm.runtime.tensor(restored(data, case["weight"] + "_wp", case["dtype"]))
    w = data[case["weight"] + "_w"]
    n, k, worst = case["n"], case["k"], 0.0
    if case["epilogue"] == "silu_mul":
        for m in (1, 3, 33, 200):
            a = data[f"s{m}"]
            g, u = np.split(product_as_seen(a, w, mode_at(case["modes"], m)), 2, axis=1)
            want = g / (1 + np.exp(-g)) * u
            y = tvm.runtime.empty((m, n // 2), "float32", dev)
            fn(tvm.runtime.tensor(a), wp, y)
            err = np.abs(y.numpy() - want) - (1e-3 + 1e-4 * np.abs(want))
            worst = max(worst, float(err.max()))
            if not np.isfinite(y.numpy()).all():
                worst = float("inf")
        return {"ok": worst <= 0, "excess": worst}
    for m in CHECK_M:
        a = data[f"a{k}_{m}"]
        want = product_as_seen(a, w, mode_at(case["modes"], m))
        y = tvm.runtime.empty((m, n), "float32", dev)
        args = [tvm.runtime.tensor(a), wp]
        if case["epilogue"] == "residual":
            r = data[case["weight"] + "_r"][:m]
            args.append(tvm.runtime.tensor(r))
            want = want + r
        fn(*args, y)
        err = np.abs(y.numpy() - want) - (1e-4 * np.sqrt(k) + 1e-4 * np.abs(want))
        worst = max(worst, float(err.max()))
        if not np.isfinite(y.numpy()).all():
            worst = float("inf")
    return {"ok": worst <= 0, "excess": worst}


def _timing_weight(t: dict) -> np.ndarray:
    """Random packed bytes with every block's d (and m) a normal fp16 value: timing needs no
    meaningful weight, but no NaN or subnormal either."""
    rng = np.random.default_rng(1)
    wp = rng.integers(0, 256, size=t["packed"], dtype=np.uint8)
    wp[:, :, : t["head"]] = np.frombuffer(np.float16(0.01).tobytes() * (t["head"] // 2), np.uint8)
    return wp


def run(bundle: Path, rounds: int, isas: set[str] | None = None) -> dict:
    from .. import host

    manifest = json.loads((bundle / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"error: {bundle} is not a crosscheck bundle of format {FORMAT}; rebuild it")
    import tvm

    host.enable_amx()
    data = np.load(bundle / "data.npz")
    # the CPU this runs on (not one SANDWICH_CPU describes); emulated: its model name says so
    info, flags, emulated = host.own_cpuinfo(), host.own_cpu_flags(), host.emulated()
    isa = host.isa_of(flags)
    report = {"cpu": {"model": info.get("model name", "?"), "family": info.get("cpu family"),
                      "model_number": info.get("model"), "isa": isa,
                      "machine": platform.machine(), "emulated": emulated,
                      "flags": sorted(f for f in flags if f in host.LLVM_FEATURES)},
              "checks": [], "timings": []}
    if emulated and [t for t in manifest["timings"] if not isas or t["isa"] in isas]:
        raise SystemExit(f"error: this {platform.machine()} Python is emulated; its times would mean "
                         "nothing: rebuild the bundle with --no-timing")
    for case in manifest["cases"]:
        if isas and case["isa"] not in isas:
            continue
        row = {k: case[k] for k in ("isa", "dtype", "epilogue")}
        if not host.can_run(case["isa"]):
            row.update(ok=None, skipped=f"this CPU ({isa}) cannot run {case['isa']} code")
        else:
            fn = tvm.runtime.load_module(str(bundle / case["lib"]))["linear"]
            row.update(_check(fn, case, data, tvm))
        report["checks"].append(row)
        print(json.dumps(row), flush=True)
    runnable = [t for t in manifest["timings"] if host.can_run(t["isa"]) and (not isas or t["isa"] in isas)]
    fns = {t["lib"]: tvm.runtime.load_module(str(bundle / t["lib"]))["linear"] for t in runnable}
    weights = {t["lib"]: tvm.runtime.tensor(_timing_weight(t)) for t in runnable}
    rng = np.random.default_rng(2)
    for m in manifest["time_m"]:
        samples: dict[str, list[float]] = {t["lib"]: [] for t in runnable}
        inputs = {(n, k): (tvm.runtime.tensor(rng.standard_normal((m, k)).astype(np.float32)),
                           tvm.runtime.empty((m, n), "float32", tvm.cpu()))
                  for n, k in sorted({(t["n"], t["k"]) for t in runnable})}
        for _ in range(rounds):  # the ISAs take turns
            for t in runnable:
                a, y = inputs[(t["n"], t["k"])]
                fn = fns[t["lib"]]
                fn(a, weights[t["lib"]], y)
                start = time.perf_counter()
                reps = 0
                while reps < 3 or time.perf_counter() - start < 0.05:
                    fn(a, weights[t["lib"]], y)
                    reps += 1
                samples[t["lib"]].append((time.perf_counter() - start) / reps)
        for t in runnable:
            sec = float(np.median(samples[t["lib"]]))
            row = {"isa": t["isa"], "dtype": t["dtype"], "n": t["n"], "k": t["k"], "m": m,
                   "ms": sec * 1e3, "gflops": 2 * m * t["n"] * t["k"] / sec / 1e9}
            report["timings"].append(row)
            print(json.dumps(row), flush=True)
    return report


def add_crosscheck_parser(sub) -> None:
    p = sub.add_parser("crosscheck", help="build kernels here to check and time them on another CPU")
    _arguments(p)


def _arguments(p: argparse.ArgumentParser) -> None:
    verbs = p.add_subparsers(dest="verb", required=True)
    b = verbs.add_parser("build", help="build the kernels, weights and inputs into a bundle")
    b.add_argument("--isas", default="amxdq,amxint8,avxvnni,avx512vnni,avx512dot",
                   help="comma-separated micro-kernel ISAs (default amxdq,amxint8,avxvnni,avx512vnni,"
                        "avx512dot)")
    b.add_argument("--dtypes", default="q8_0,q4_0,q4_1",
                   help="comma-separated weight types; each ISA builds those it computes "
                        "(default q8_0,q4_0,q4_1)")
    b.add_argument("--out", type=Path, required=True, help="the bundle directory")
    b.add_argument("--no-timing", action="store_true", help="build the checked kernels only")
    b.set_defaults(json=None)
    r = verbs.add_parser("run", help="check and time a bundle's kernels on this CPU")
    r.add_argument("bundle", type=Path)
    r.add_argument("--rounds", type=int, default=5, help="timing rounds, ISAs interleaved (default 5)")
    r.add_argument("--json", type=Path, default=None, help="write the report here")
    r.add_argument("--isas", default="", help="only these ISAs (comma-separated; default all)")


def main_crosscheck(args: argparse.Namespace) -> int:
    from ..host import HostError

    try:
        return _main(args)
    except HostError as err:  # a bad SANDWICH_CPU or SANDWICH_MAX_ISA: one line, not a traceback
        raise SystemExit(f"error: {err}") from err


def _main(args: argparse.Namespace) -> int:
    if args.verb == "build":
        build([s for s in args.isas.split(",") if s], args.out, [s for s in args.dtypes.split(",") if s],
              () if args.no_timing else TIME_SHAPES)
        return 0
    report = run(args.bundle, args.rounds, {s for s in args.isas.split(",") if s})
    if args.json:
        from ..host import save_atomic

        save_atomic(args.json, json.dumps(report, indent=1))
    failed = [c for c in report["checks"] if c.get("ok") is False]
    ran = sum(c.get("ok") is not None for c in report["checks"])
    print(f"{ran - len(failed)} of {ran} kernels agree with numpy on {report['cpu']['model']}"
          f" ({len(report['checks']) - ran} skipped)")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m sandwich_tvm.bench.crosscheck", description=__doc__)
    _arguments(parser)
    sys.exit(main_crosscheck(parser.parse_args()))
