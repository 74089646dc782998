"""`python -m sandwich_tvm.bench gemm|e2e|attention|serve|allreduce|agreement|perplexity|imatrix|prefix-cache|
speculative|structured|costmodel|tuning-curve|crosscheck|hop|cache-resident|pool`: Sandwich's dynamic-shape
GEMM against numpy and torch (``e2e``: the whole model, see ``bench/e2e.py``;
``attention``: the KV cache's attention kernels against TVM's, ``bench/attention.py``; ``serve``:
the serving benchmark over the OpenAI API, SLO attainment and goodput, ``bench/serve_cmd.py``;
``allreduce``: the shared-memory all-reduce against gloo, ``bench/allreduce.py``; ``agreement``: a
16-bit model's greedy tokens against its fp32 model's, ``bench/agreement_cmd.py``;
``perplexity``: perplexity on ShareGPT per weight type, ``bench/perplexity.py``; ``imatrix``: an
importance matrix by llama-imatrix on other ShareGPT text, ``bench/imatrix.py``; ``prefix-cache``:
TTFT of a request whose long prefix is cached, ``bench/prefix.py``; ``speculative``: decode speed
with prompt-lookup drafts, ``bench/speculative.py``; ``structured``: what JSON-schema requests
cost the requests batched with them, ``bench/structured.py``; ``costmodel``: the learned cost
model's ranking on held-out shapes, ``bench/costmodel.py``; ``tuning-curve``: a served model's
tokens/s as background tuning lands records, ``bench/tuning_curve.py``; ``crosscheck``: kernels
built here, checked against numpy and timed on a CPU with TVM's runtime only,
``bench/crosscheck.py``; ``hop``: per-hop latency and bandwidth to a worker host, ``bench/hop.py``;
``cache-resident``: modelled pipelines of cache-resident sockets per batch, ``bench/cache_resident.py``;
``pool``: the thread pool's cost per tiny decode operator, ``bench/pool.py``).

Everything runs in one process on the same thread count; each number is the median of
timed repeats after a warm-up. The Sandwich kernel comes from the tuning database under
``schedules/`` (tuned on the spot when missing); the tuning time is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int, positive_ints, threads_beyond_cpus
from ..cli.common import print_error
from ..host import require_own_cpu
from ..kernels.schedule import EPILOGUES
from .agreement_cmd import add_agreement_parser, main_agreement
from .allreduce import add_allreduce_parser, main_allreduce
from .attention import add_attention_parser, main_attention
from .cache_resident import add_cache_resident_parser, main_cache_resident
from .cold import cold_rotation, llc_bytes_of
from .compile_time import add_compile_parser, main_compile_time
from .costmodel import add_costmodel_parser, main_costmodel
from .crosscheck import add_crosscheck_parser, main_crosscheck
from .e2e import add_e2e_parser, main_e2e
from .hop import add_hop_parser, main_hop
from .imatrix import add_imatrix_parser, main_imatrix
from .perplexity import add_perplexity_parser, main_perplexity
from .pool import add_pool_parser, main_pool
from .prefix import add_prefix_parser, main_prefix
from .serve_cmd import add_serve_parser, main_serve
from .speculative import add_speculative_parser, main_speculative
from .structured import add_structured_parser, main_structured
from .timing import median_seconds, paired_median_ratio, rotating
from .tuning_curve import add_tuning_curve_parser, main_tuning_curve

DEFAULT_M = "1,2,4,8,16,32,64,128,256,512"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sandwich_tvm.bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gemm", help="Y = X @ W.T for a list of m")
    g.add_argument("--n", type=positive_int, required=True, help="output features (rows of W)")
    g.add_argument("--k", type=positive_int, required=True, help="input features")
    g.add_argument("--m", default=DEFAULT_M, help=f"comma-separated sequence lengths (default {DEFAULT_M})")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="threads for every library (default: all cores)")
    g.add_argument("--schedules", type=Path, default=None, help="tuning database root (default schedules/)")
    g.add_argument("--hot-weights", action="store_true",
                   help="time every call on one weight (cache-resident when it fits); default: rotate "
                        "copies over twice the last-level cache, and the benchmark CPUs' caches together "
                        "(at least 96 MB), so weights come from memory, as in a served model; checked in "
                        "the run (at m = 1 no library may beat a streaming read) and doubled until so")
    g.add_argument("--metaschedule-trials", type=int, default=0,
                   help="also tune MetaSchedule's default search with this many trials (0: skip)")
    g.add_argument("--metaschedule-m", type=positive_int, default=128,
                   help="m of the MetaSchedule run (default 128)")
    g.add_argument("--rounds", type=positive_int, default=5,
                   help="rounds in which the libraries take turns at each m; GFLOPS are medians over "
                        "rounds, ratios the medians of each round's paired ratios (default 5)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "q8_0", "q4_0", "q4_1"),
                   default="float32",
                   help="the weight's precision: Sandwich's kernel for it, torch's F.linear in it "
                        "(oneDNN; AMX or AVX512-BF16 where present), numpy in fp32 (default float32). "
                        "Quantized types (llama.cpp's blocks, int8 activations where the CPU has an int8 "
                        "dot product): numpy and torch multiply the dequantized weights, torch in bf16 "
                        "where the CPU has a bf16 unit, as `generate` runs it, else fp32")
    g.add_argument("--epilogue", choices=EPILOGUES, default="none",
                   help="what follows the GEMM, as the model runs it: Sandwich fuses it (its record "
                        "tuned with it), numpy and torch run it after the product: residual (+ R), "
                        "bias (+ b), silu_mul (silu(gate) * up of a gate_up GEMM) (default none)")
    g.add_argument("--against", type=Path, default=None, metavar="DIR",
                   help="also time the kernel of another tuning of this GEMM, read from the records "
                        "directory DIR (e.g. the full search's against the model-guided one's in "
                        "--schedules), taking turns with the others; rows get ratio_vs_against")
    g.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    g.add_argument("--plot", type=Path, default=Path("out/bench_gemm.png"), help="PNG plot path")
    add_e2e_parser(sub)
    add_attention_parser(sub)
    add_serve_parser(sub)
    add_allreduce_parser(sub)
    add_agreement_parser(sub)
    add_perplexity_parser(sub)
    add_imatrix_parser(sub)
    add_prefix_parser(sub)
    add_speculative_parser(sub)
    add_structured_parser(sub)
    add_costmodel_parser(sub)
    add_tuning_curve_parser(sub)
    add_crosscheck_parser(sub)
    add_hop_parser(sub)
    add_cache_resident_parser(sub)
    add_pool_parser(sub)
    add_compile_parser(sub)
    return parser


LIBRARIES = ("sandwich", "numpy", "torch")  # bench gemm's libraries, in the order they take turns
SPIN_PAUSE_S = 0.3  # after each library's turn: OpenBLAS and OpenMP workers stop spinning


def bench_gemm(n: int, k: int, ms: list[int], threads: int, root: Path | None, log,
               hot: bool = False, ms_trials: int = 0, ms_m: int = 128, rounds: int = 5,
               dtype: str = "float32", epilogue: str = "none", against: Path | None = None) -> dict:
    import torch
    from threadpoolctl import threadpool_limits

    from ..host import cold_weight_bytes, cpu_flags
    from ..kernels.codegen import linear_primfunc
    from ..kernels.database import find_record
    from ..kernels.microkernel import kernel_isa
    from ..kernels.packing import WeightLayout, numpy_dtype
    from ..kernels.peak import fma_peak_gflops
    from ..kernels.quant import QuantBlocks, qtype
    from ..kernels.schedule import GemmShape
    from ..kernels.tuner import tune_gemm
    from ..topology.microbench import sgemm_gflops
    from ..tvm_compat import host_isa, host_target, tvm
    from .baselines.torch_hf import torch_dtype

    if epilogue != "none" and ms_trials > 0:
        raise ValueError("--metaschedule-trials tunes the plain GEMM; run it without --epilogue")
    shape = GemmShape(n, k, dtype, epilogue)
    rec_b = find_record(shape, threads, against) if against is not None else None
    if against is not None and rec_b is None:
        raise ValueError(f"--against {against}: no record of {shape.name} for {threads} threads on this CPU")
    rec = find_record(shape, threads, root)
    if rec is None or rec.shape != shape or max(t.m for t in rec.tuned) < max(ms):
        log(f"tuning n={n} k={k} ({dtype}, epilogue {epilogue}) for m <= {max(ms)} on {threads} threads "
            "(resumable) ...")
        rec = tune_gemm(n, k, threads=threads, max_m=max(ms), root=root, dtype=dtype, epilogue=epilogue,
                        progress=lambda t: log(f"  m={t.m}: {t.schedule.key} "
                                               f"{'' if math.isnan(t.gflops) else f'{t.gflops:.1f} GFLOPS'}"))
    def build(r):
        return tvm.compile(tvm.IRModule({"main": linear_primfunc(shape, r.buckets(), "main")}),
                           target=host_target(threads)).mod["main"]

    fn = build(rec)
    fn_b = build(rec_b) if rec_b is not None else None
    libraries = ("sandwich", "against", "numpy", "torch") if fn_b is not None else LIBRARIES
    rng = np.random.default_rng(0)
    # Cold weights (default): enough copies to overflow the caches, all CPUs' together, used in
    # turn; checked in the run against a streaming read (bench/cold.py), grown if they were not.
    layout = WeightLayout(kernel_isa(host_isa(), dtype, cpu_flags()), dtype, epilogue == "silu_mul")
    quant = qtype(dtype)
    wbytes = quant.block_bytes / 32 if quant is not None else numpy_dtype(dtype).itemsize
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    cold_bytes = max(cold_weight_bytes(), 2 * llc_bytes_of(cpus))
    copies = 1 if hot else max(1, math.ceil(cold_bytes / (n * k * wbytes)))
    torch.set_num_threads(threads)
    # torch runs in the dtype asked, as its users would; quantized weights have no torch kernel: their
    # values (dequantized) in the dtype torch's users run a model in on this CPU
    torch_name = torch_dtype("auto")[0] if quant is not None else dtype
    t_dtype = getattr(torch, torch_name)
    ws: list[np.ndarray] = []
    wps: list = []
    wts: list = []
    packed_bytes: list[int] = []

    def add_copies(count: int) -> None:
        while len(ws) < count:  # weights exactly representable in ``dtype``: the same values everywhere
            if quant is not None:  # the blocks' values, and the kernel packs those blocks
                raw = quant.quantize(rng.standard_normal((n, k)).astype("float32"))
                ws.append(quant.dequantize(raw).astype("float32"))
                packed = layout.pack(QuantBlocks(raw, quant, k))
            else:
                ws.append(rng.standard_normal((n, k)).astype(numpy_dtype(dtype)).astype("float32"))
                packed = layout.pack(ws[-1])
            packed_bytes.append(packed.nbytes)
            wps.append(tvm.runtime.tensor(packed))
            wts.append(torch.from_numpy(ws[-1]).to(t_dtype))

    add_copies(copies)
    w = ws[0]
    log(f"Sandwich: {dtype} weights on {layout.isa} micro-kernels; torch F.linear in {torch_name}; "
        "numpy in float32")
    ms_row = None
    if ms_trials > 0:
        from .baselines.metaschedule import tune_default

        ms_fn, ms_secs = tune_default(ms_m, n, k, threads, ms_trials, log)
        ms_row = {"m": ms_m, "trials": ms_trials, "tuning_seconds": ms_secs}
    all_m = sorted(set(ms) | ({1} if not hot else set()))  # the cold check runs at m = 1
    xs = {m: rng.standard_normal((m, k)).astype("float32") for m in all_m}
    n_out = n // 2 if epilogue == "silu_mul" else n
    # the epilogue's operands per m: R[m, n] or b[n]; numpy and torch apply it after the product
    extras = {m: [rng.standard_normal((m, n) if epilogue == "residual" else (n,)).astype("float32")]
              if epilogue in ("residual", "bias") else [] for m in all_m}
    xt = {m: torch.from_numpy(xs[m]).to(t_dtype) for m in all_m}
    et = {m: [torch.from_numpy(e).to(t_dtype) for e in extras[m]] for m in all_m}
    numpy_linear, torch_linear = _unfused(epilogue, n)

    def calls_at(m: int) -> dict[str, Callable[[], object]]:
        """Each library's call at ``m``, on the next weight copy each time."""
        ta, y = tvm.runtime.tensor(xs[m]), tvm.runtime.empty((m, n_out), "float32", tvm.cpu())
        ev = [tvm.runtime.tensor(e) for e in extras[m]]
        out = {"sandwich": rotating(fn, [(ta, wp, *ev, y) for wp in wps])}
        if fn_b is not None:
            out["against"] = rotating(fn_b, [(ta, wp, *ev, y) for wp in wps])
        return out | {
                "numpy": rotating(numpy_linear, [(xs[m], wi.T, *extras[m]) for wi in ws]),
                "torch": rotating(torch_linear, [(xt[m], wt, *et[m]) for wt in wts])}

    with threadpool_limits(threads):
        peak = sum(sgemm_gflops(c) for c in sorted(os.sched_getaffinity(0))[:threads])
        fma_peak = fma_peak_gflops(threads)
        log(f"FMA peak ({threads} threads, register-only loop): {fma_peak:.0f} GFLOPS; "
            f"OpenBLAS SGEMM x {threads} cores: {peak:.0f} GFLOPS; weights: "
            + ("hot" if hot else f"{copies} copies over {int(copies * ws[0].size * wbytes) >> 20} MB"))
        errs = {}
        for m in ms:
            ta, y = tvm.runtime.tensor(xs[m]), tvm.runtime.empty((m, n_out), "float32", tvm.cpu())
            fn(ta, wps[0], *[tvm.runtime.tensor(e) for e in extras[m]], y)
            ref = numpy_linear(xs[m], w.T, *extras[m])
            errs[m] = float(np.abs(y.numpy() - ref).max() / max(1e-30, np.abs(ref).max()))
        cold = None
        if not hot:
            one = {"sandwich": packed_bytes[0], "numpy": ws[0].nbytes,
                   "torch": wts[0].element_size() * wts[0].numel()}
            if fn_b is not None:
                one["against"] = one["sandwich"]
            cold = cold_rotation(copies, add_copies, lambda: calls_at(1), one, sum(one.values()), cpus, log,
                                 SPIN_PAUSE_S)
            copies = cold["copies"]
        if ms_row is not None:
            ta = tvm.runtime.tensor(xs.get(ms_m, rng.standard_normal((ms_m, k)).astype("float32")))
            y = tvm.runtime.empty((ms_m, n), "float32", tvm.cpu())
            wms = [tvm.runtime.tensor(wi) for wi in ws]
            ms_fn(ta, wms[0], y)
            ref = ta.numpy() @ w.T
            ms_row["max_rel_err"] = float(np.abs(y.numpy() - ref).max() / max(1e-30, np.abs(ref).max()))
            secs = median_seconds(rotating(ms_fn, [(ta, wi, y) for wi in wms]))
            ms_row["gflops"] = 2.0 * ms_m * n * k / secs / 1e9
        # The libraries take turns at each m, so every round's three timings are seconds apart
        # and their ratios are paired: this host's speed drifts by tens of percent over minutes
        # (memory bandwidth and compute alike, on a shared machine). OpenBLAS and OpenMP workers
        # spin for a while after a call, so each library gets the cores to itself after a pause.
        sweeps: dict[str, dict[int, list[float]]] = {lib: {m: [] for m in ms} for lib in libraries}
        for r in range(rounds):
            log(f"round {r + 1}/{rounds}: {', '.join(libraries)} at each m = {ms[0]}..{ms[-1]}")
            for m in ms:
                calls = calls_at(m)
                for lib in libraries:
                    sweeps[lib][m].append(median_seconds(calls[lib]))
                    time.sleep(SPIN_PAUSE_S)
    rows = []
    for m in ms:
        flops = 2.0 * m * n * k
        sw, nm, th = (sweeps[lib][m] for lib in LIBRARIES)
        row = {"m": m, "sandwich_gflops": flops / float(np.median(sw)) / 1e9,
               "numpy_gflops": flops / float(np.median(nm)) / 1e9,
               "torch_gflops": flops / float(np.median(th)) / 1e9, "max_rel_err": errs[m],
               "seconds": {lib: sweeps[lib][m] for lib in libraries}}
        if fn_b is not None:
            row["against_gflops"] = flops / float(np.median(sweeps["against"][m])) / 1e9
            row["ratio_vs_against"] = paired_median_ratio(sw, sweeps["against"][m])
            row["against_schedule"] = rec_b.schedule_for(m).key
        row["ratio_vs_torch"] = paired_median_ratio(sw, th)
        row["ratio_vs_best"] = paired_median_ratio(sw, [min(a, b) for a, b in zip(nm, th, strict=True)])
        row["peak_fraction"] = row["sandwich_gflops"] / peak
        row["fma_peak_fraction"] = row["sandwich_gflops"] / fma_peak
        row["schedule"] = rec.schedule_for(m).key
        rows.append(row)
    ratios = [r["ratio_vs_best"] for r in rows]
    vs_torch = [r["ratio_vs_torch"] for r in rows]
    out = {"n": n, "k": k, "dtype": dtype, "torch_dtype": torch_name, "epilogue": epilogue,
           "kernel_isa": layout.isa, "threads": threads,
           "geomean_vs_torch": float(np.exp(np.mean(np.log(vs_torch)))), "min_vs_torch": min(vs_torch),
           "weights": "hot" if hot else "cold", "peak_gflops": peak,
           "fma_peak_gflops": fma_peak, "weight_copies": copies, "cold_check": cold,
           "tuning_seconds": rec.seconds, "geomean_ratio": float(np.exp(np.mean(np.log(ratios)))),
           "min_ratio": min(ratios), "rows": rows}
    if rec_b is not None:
        vs = [r["ratio_vs_against"] for r in rows]
        out["against"] = {"records": str(against), "search": rec_b.search, "tuning_seconds": rec_b.seconds,
                          "shape": rec_b.shape.name, "geomean_ratio": float(np.exp(np.mean(np.log(vs)))),
                          "min_ratio": min(vs)}
        out["search"] = rec.search
    if ms_row is not None:
        sw = next((r["sandwich_gflops"] for r in rows if r["m"] == ms_m), None)
        if sw is not None:
            ms_row["sandwich_ratio"] = sw / ms_row["gflops"]
        out["metaschedule"] = ms_row
    return out


def _unfused(epilogue: str, n: int):
    """``(numpy, torch)`` functions of ``(x, W.T or W, *operands)``: the product, then the
    epilogue as their users write it (``F.linear(x, w) + r``; ``F.silu(gate) * up`` on the two
    halves of a gate_up product)."""
    import torch

    half = n // 2

    def numpy_linear(x, wt, *ops):
        y = x @ wt
        if epilogue == "silu_mul":
            gate = y[:, :half]
            return gate / (1 + np.exp(-gate)) * y[:, half:]
        return y + ops[0] if ops else y

    def torch_linear(x, w, *ops):
        y = torch.nn.functional.linear(x, w)
        if epilogue == "silu_mul":
            return torch.nn.functional.silu(y[:, :half]) * y[:, half:]
        return y + ops[0] if ops else y

    return numpy_linear, torch_linear


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [r["m"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("sandwich_gflops", "Sandwich"), ("numpy_gflops", "numpy (OpenBLAS)"),
                       ("torch_gflops", f"torch ({result.get('dtype', 'float32')})")):
        ax.plot(ms, [r[key] for r in result["rows"]], marker="o", label=label)
    ax.axhline(result["fma_peak_gflops"], ls="--", c="black", label="measured FMA peak")
    ax.axhline(result["peak_gflops"], ls=":", c="grey", label="OpenBLAS SGEMM x threads")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m (tokens)")
    ax.set_ylabel("GFLOPS")
    ax.set_title(f"{result.get('dtype', 'float32')} GEMM n={result['n']} k={result['k']}, "
                 f"{result['threads']} threads")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=args.json)
    if args.what != "crosscheck":  # builds for any CPU; the rest time and run code here
        require_own_cpu(f"bench {args.what}")
    if args.what == "e2e":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_e2e(args, console)
    if args.what == "attention":
        return main_attention(args, console)
    if args.what == "serve":
        return main_serve(args, console)
    if args.what == "allreduce":
        return main_allreduce(args, console)
    if args.what == "agreement":
        return main_agreement(args, console)
    if args.what == "perplexity":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_perplexity(args, console)
    if args.what == "imatrix":
        return main_imatrix(args, console)
    if args.what == "prefix-cache":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_prefix(args, console)
    if args.what == "speculative":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_speculative(args, console)
    if args.what == "costmodel":
        try:
            return main_costmodel(args, console)
        except ValueError as exc:
            print_error(console, exc)
            return 2
    if args.what == "crosscheck":
        return main_crosscheck(args)
    if args.what == "pool":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_pool(args, console)
    if args.what == "cache-resident":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_cache_resident(args, console)
    if args.what == "hop":
        from ..runtime.disco_group import DiscoError
        from ..topology.hosts import HostError

        try:
            return main_hop(args)
        except (DiscoError, HostError) as exc:
            print_error(console, exc)
            return 2
    if args.what == "compile":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_compile_time(args, console)
    if args.what == "tuning-curve":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_tuning_curve(args, console)
    if args.what == "structured":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return main_structured(args, console)
    threads = args.threads or len(os.sched_getaffinity(0))
    if too_many := threads_beyond_cpus(threads):
        print_error(console, too_many)
        return 2
    try:
        ms = positive_ints(args.m, "--m")
    except ValueError as exc:
        print_error(console, f"bad --m {args.m!r}: {exc}")
        return 2
    from ..kernels.database import ScheduleDbError

    try:
        result = bench_gemm(args.n, args.k, ms, threads, args.schedules, console.print,
                            hot=args.hot_weights, ms_trials=args.metaschedule_trials,
                            ms_m=args.metaschedule_m, rounds=args.rounds, dtype=args.dtype,
                            epilogue=args.epilogue, against=args.against)
    except (ScheduleDbError, ValueError) as exc:
        print_error(console, exc)
        return 2
    plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    fused = "" if args.epilogue == "none" else f" + {args.epilogue}"
    table = Table(title=f"{args.dtype} GEMM{fused} n={args.n} k={args.k}, {threads} threads (median GFLOPS)")
    for col in ("m", "Sandwich", "numpy fp32", f"torch {args.dtype}", "vs torch", "vs best", "of FMA peak",
                "schedule"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(str(r["m"]), f"{r['sandwich_gflops']:.1f}", f"{r['numpy_gflops']:.1f}",
                      f"{r['torch_gflops']:.1f}", f"{r['ratio_vs_torch']:.2f}x", f"{r['ratio_vs_best']:.2f}x",
                      f"{r['fma_peak_fraction']:.0%}", r["schedule"])
    console.print(table)
    if "metaschedule" in result:
        r = result["metaschedule"]
        vs = f", Sandwich {r['sandwich_ratio']:.2f}x" if "sandwich_ratio" in r else ""
        console.print(f"MetaSchedule default search, m={r['m']}: {r['gflops']:.1f} GFLOPS after "
                      f"{r['trials']} trials in {r['tuning_seconds']:.0f} s{vs}")
    console.print(f"geomean vs torch {result['geomean_vs_torch']:.2f}x (min {result['min_vs_torch']:.2f}x); "
                  f"vs best library {result['geomean_ratio']:.2f}x (min {result['min_ratio']:.2f}x); "
                  f"FMA peak {result['fma_peak_gflops']:.0f} GFLOPS; "
                  f"tuning {result['tuning_seconds']:.0f} s; plot {args.plot}")
    if "against" in result:
        a = result["against"]
        console.print(f"against {a['records']} ({a['search']} search, {a['tuning_seconds']:.0f} s): "
                      f"geomean {a['geomean_ratio']:.3f}x (min {a['min_ratio']:.2f}x), paired by round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
