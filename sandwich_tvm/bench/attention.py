"""`python -m sandwich_tvm.bench attention`: the KV cache's attention kernels, Sandwich's against TVM's.

Both kernels get the same inputs in one process. Prefill: one sequence of ``--prompt`` new
tokens, causal. Decode: one query token against ``--context`` keys in 16-token pages, with a
separate cache per layer (``--layers``) so K/V come from memory as in a decode step. The
outputs are compared (the run fails on a mismatch) and the times, GFLOPS / GB/s and their
ratio reported. Where the CPU has AMX, the prefill kernel a bf16 model runs there (bf16 operands
on AMX tiles) is timed on the same inputs too. ``--kv-dtypes`` times Sandwich's decode kernel on
each KV cache storage (the same values: 16-bit, int8 rows with their scales), the dtypes taking
turns over ``--rounds``; each row's ratio is the median of its per-round time over the first's.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.common import print_error
from ..host import host_signature
from ..kernels.attention import check_kv_dtype
from ..model.config import ModelConfigError, load_config
from .timing import median_seconds


def _page_table(context: int, npages: int) -> list:
    """The decode kernel's page arguments for one sequence of ``context`` keys in ``npages``
    consecutive pages: indptr, page indices, last page's length, two zero RoPE offsets."""
    from ..tvm_compat import tvm

    return [tvm.runtime.tensor(a) for a in (
        np.array([0, npages], np.int32), np.arange(npages, dtype=np.int32),
        np.array([context - (npages - 1) * PAGE], np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32))]

PAGE = 16


def add_attention_parser(sub) -> None:
    a = sub.add_parser("attention", help="prefill and decode attention kernels: Sandwich vs TVM's")
    a.add_argument("--model", default="llama-160m", help="preset or HF directory: heads, KV heads, head dim")
    a.add_argument("--prompt", type=int, default=512, help="prefill tokens (default 512)")
    a.add_argument("--context", type=int, default=1024, help="decode context length (default 1024)")
    a.add_argument("--layers", type=int, default=None,
                   help="decode caches timed per step (default: the model's layers)")
    a.add_argument("--kv-dtypes", default="float16,int8",
                   help="KV cache storages whose decode is compared, the first the base "
                        "(default float16,int8)")
    a.add_argument("--rounds", type=int, default=5, help="rounds of the KV-dtype comparison (default 5)")
    a.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def bench_prefill(h_kv: int, h_q: int, d: int, n: int, log) -> dict:
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_prefill_ragged_cpu

    from ..host import can_run
    from ..kernels.attention import prefill_ragged_primfunc
    from ..kernels.attention_amx import prefill_ragged_amx_primfunc, supports
    from ..tvm_compat import host_target, tvm

    rng = np.random.default_rng(0)
    q = rng.standard_normal((n, h_q, d), dtype=np.float32)
    k, v = (rng.standard_normal((n, h_kv, d), dtype=np.float32) for _ in range(2))
    indptr, pos = np.array([0, n], np.int32), np.zeros(n, np.int32)
    args = [tvm.runtime.tensor(a) for a in (q, indptr, k, v, indptr, pos, np.zeros(1, np.int32))]
    scalars = (1, 0, 1.0, 1e4, d ** -0.5)  # causal, rotary_mode, rope_scale, rope_theta, sm_scale
    row = {"kernel": "prefill", "tokens": n}
    outs = {}
    for name, func in (("sandwich", prefill_ragged_primfunc(h_kv, h_q, d)),
                       ("tvm", _attention_prefill_ragged_cpu(h_kv, h_q, d, d, "float32", {}))):
        log(f"prefill attention, {n} tokens: {name}")
        run = tvm.compile(func, target=host_target())["batch_prefill_ragged_kv"]
        out = tvm.runtime.empty((n, h_q, d), "float32", tvm.cpu())
        lse = tvm.runtime.empty((n, h_q), "float32", tvm.cpu())
        secs = median_seconds(lambda run=run, out=out, lse=lse: run(*args, out, lse, *scalars))
        outs[name] = out.numpy()
        row[f"{name}_ms"] = secs * 1e3
        row[f"{name}_gflops"] = 2 * n * (n + 1) * h_q * d / secs / 1e9  # QK and PV, causal half
    row["max_abs_diff"] = float(np.abs(outs["sandwich"] - outs["tvm"]).max())
    row["ratio"] = row["sandwich_ms"] / row["tvm_ms"]
    if can_run("amx") and supports(d):  # what a bf16 model on AMX runs: bf16 operands, fp32 sums
        log(f"prefill attention, {n} tokens: sandwich on AMX tiles (bf16)")
        run = tvm.compile(prefill_ragged_amx_primfunc(h_kv, h_q, d), target=host_target())
        run = run["batch_prefill_ragged_kv"]
        out = tvm.runtime.empty((n, h_q, d), "float32", tvm.cpu())
        lse = tvm.runtime.empty((n, h_q), "float32", tvm.cpu())
        secs = median_seconds(lambda: run(*args, out, lse, *scalars))
        row["amx_ms"], row["amx_gflops"] = secs * 1e3, 2 * n * (n + 1) * h_q * d / secs / 1e9
        row["amx_max_abs_diff"] = float(np.abs(out.numpy() - outs["tvm"]).max())
        row["amx_ratio"] = row["amx_ms"] / row["tvm_ms"]
    return row


def bench_decode(h_kv: int, h_q: int, d: int, context: int, layers: int, log) -> dict:
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode_cpu

    from ..kernels.attention import decode_paged_primfunc
    from ..tvm_compat import PROCESS_CPUS, host_target, tvm

    rng = np.random.default_rng(0)
    npages = -(-context // PAGE)
    q = tvm.runtime.tensor(rng.standard_normal((1, h_q, d), dtype=np.float32))
    meta = _page_table(context, npages)
    caches = [tvm.runtime.tensor(rng.standard_normal((npages, 2, h_kv, PAGE, d), dtype=np.float32))
              for _ in range(layers)]
    row = {"kernel": "decode", "context": context, "layers": layers}
    outs = {}
    split = 2 * len(PROCESS_CPUS)
    for name, func in (("sandwich", decode_paged_primfunc(h_kv, h_q, d, PAGE, split)),
                       ("tvm", _attention_decode_cpu(h_kv, h_q, d, "float32", False, {}))):
        log(f"decode attention, context {context} x {layers} layers: {name}")
        run = tvm.compile(func, target=host_target())["batch_decode_paged_kv_cpu"]
        out = tvm.runtime.empty((1, h_q, d), "float32", tvm.cpu())
        lse = tvm.runtime.empty((1, h_q), "float32", tvm.cpu())

        def step(run=run, out=out, lse=lse) -> None:
            for pages in caches:
                run(q, pages, *meta, out, lse, 0, 1.0, 1e4, d ** -0.5)

        secs = median_seconds(step)
        outs[name] = out.numpy()
        row[f"{name}_ms"] = secs * 1e3
        row[f"{name}_gbs"] = layers * context * 2 * h_kv * d * 4 / secs / 1e9
    row["max_abs_diff"] = float(np.abs(outs["sandwich"] - outs["tvm"]).max())
    row["ratio"] = row["sandwich_ms"] / row["tvm_ms"]
    return row


def bench_decode_kv_dtypes(h_kv: int, h_q: int, d: int, context: int, layers: int, dtypes: list[str],
                           rounds: int, log) -> list[dict]:
    """Sandwich's decode kernel on the same K/V stored as each of ``dtypes``, taking turns."""
    from ..kernels.attention import decode_paged_primfunc
    from ..kernels.kv_int8 import pack_rows, row_width, unpack_rows
    from ..spec import kv_value_bytes
    from ..tvm_compat import PROCESS_CPUS, host_target, tvm

    rng = np.random.default_rng(1)
    npages = -(-context // PAGE)
    values = [rng.standard_normal((npages, 2, h_kv, PAGE, d), dtype=np.float32) for _ in range(layers)]
    q32 = rng.standard_normal((1, h_q, d), dtype=np.float32)
    meta = _page_table(context, npages)
    split, steps, outs, times = 2 * len(PROCESS_CPUS), {}, {}, {t: [] for t in dtypes}
    for dtype in dtypes:
        log(f"decode attention, context {context} x {layers} layers: {dtype} KV cache")
        store = pack_rows if dtype == "int8" else (lambda x, dtype=dtype: x.astype(dtype))
        caches = [tvm.runtime.tensor(store(v)) for v in values]
        q = tvm.runtime.tensor(store(q32))
        out = tvm.runtime.empty((1, h_q, row_width(d, dtype)), dtype, tvm.cpu())
        lse = tvm.runtime.empty((1, h_q), "float32", tvm.cpu())
        run = tvm.compile(decode_paged_primfunc(h_kv, h_q, d, PAGE, split, dtype=dtype), target=host_target())
        run = run["batch_decode_paged_kv_cpu"]

        def step(run=run, q=q, caches=caches, out=out, lse=lse) -> None:
            for pages in caches:
                run(q, pages, *meta, out, lse, 0, 1.0, 1e4, d ** -0.5)

        steps[dtype] = step
        outs[dtype] = lambda out=out, dtype=dtype: (unpack_rows(out.numpy()) if dtype == "int8"
                                                    else out.numpy().astype(np.float32))
    for r in range(rounds):
        for dtype in (dtypes if r % 2 == 0 else dtypes[::-1]):
            times[dtype].append(median_seconds(steps[dtype], budget_s=0.2))
    base = dtypes[0]
    rows = []
    for dtype in dtypes:
        secs = float(np.median(times[dtype]))
        kv_bytes = layers * context * 2 * h_kv * d * kv_value_bytes(dtype, d)
        rows.append({"kernel": "decode", "kv_dtype": dtype, "context": context, "layers": layers,
                     "ms": secs * 1e3, "gbs": kv_bytes / secs / 1e9, "rounds": rounds,
                     "vs_first": float(np.median([a / b for a, b in
                                                  zip(times[dtype], times[base], strict=True)])),
                     "max_abs_diff_vs_first": float(np.abs(outs[dtype]() - outs[base]()).max())})
    return rows


def main_attention(args: argparse.Namespace, console: Console) -> int:
    try:
        cfg = load_config(args.model)
    except (ModelConfigError, OSError) as exc:
        print_error(console, exc)
        return 2
    if args.prompt < 1 or args.context < 1:
        console.print("[red]error:[/] --prompt and --context must be positive")
        return 2
    try:
        dtypes = [t for t in args.kv_dtypes.split(",") if t]
        for t in dtypes:
            check_kv_dtype(t)
    except ValueError as exc:
        print_error(console, f"--kv-dtypes: {exc}")
        return 2
    h_kv, h_q, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    layers = args.layers or cfg.num_hidden_layers
    cpu = host_signature()
    rows = [bench_prefill(h_kv, h_q, d, args.prompt, console.print),
            bench_decode(h_kv, h_q, d, args.context, layers, console.print)]
    by_dtype = (bench_decode_kv_dtypes(h_kv, h_q, d, args.context, layers, dtypes, max(1, args.rounds),
                                       console.print) if dtypes else [])
    bad = [r["kernel"] for r in rows if r["max_abs_diff"] > 1e-3]
    bad += [f"{r['kv_dtype']} decode" for r in by_dtype if r["max_abs_diff_vs_first"] > 0.05]
    bad += ["AMX prefill"] * any(r.get("amx_max_abs_diff", 0) > 0.1 for r in rows)  # bf16 operands
    result = {"model": cfg.name, "heads": h_q, "kv_heads": h_kv, "head_dim": d, "rows": rows,
              "kv_dtypes": by_dtype, "cpu": f"{cpu.model_name} ({cpu.slug})"}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        table = Table(title=f"{cfg.name} attention ({h_q} heads, {h_kv} KV heads, d={d}), median ms")
        for col in ("kernel", "size", "Sandwich", "TVM", "Sandwich / TVM", "Sandwich rate", "max |diff|"):
            table.add_column(col)
        for r in rows:
            prefill = r["kernel"] == "prefill"
            size = f"{r['tokens']} tokens" if prefill else f"{r['context']} ctx x {r['layers']}"
            rate = f"{r['sandwich_gflops']:.1f} GFLOPS" if prefill else f"{r['sandwich_gbs']:.1f} GB/s"
            table.add_row(r["kernel"], size, f"{r['sandwich_ms']:.2f}", f"{r['tvm_ms']:.2f}",
                          f"{r['ratio']:.3f}", rate, f"{r['max_abs_diff']:.1e}")
            if "amx_ms" in r:
                table.add_row("prefill, AMX bf16", size, f"{r['amx_ms']:.2f}", f"{r['tvm_ms']:.2f}",
                              f"{r['amx_ratio']:.3f}", f"{r['amx_gflops']:.1f} GFLOPS",
                              f"{r['amx_max_abs_diff']:.1e}")
        console.print(table)
        if by_dtype:
            kv = Table(title=f"decode by KV cache storage, {args.context} ctx x {layers} layers "
                             f"({by_dtype[0]['rounds']} rounds, taking turns)")
            for col in ("KV cache", "median ms", "KV read", f"vs {dtypes[0]}", "max |diff|"):
                kv.add_column(col)
            for r in by_dtype:
                kv.add_row(r["kv_dtype"], f"{r['ms']:.3f}", f"{r['gbs']:.1f} GB/s", f"{r['vs_first']:.3f}",
                           f"{r['max_abs_diff_vs_first']:.1e}")
            console.print(kv)
    if bad:
        print_error(console, f"Sandwich's {', '.join(bad)} attention differs from TVM's")
        return 1
    return 0
