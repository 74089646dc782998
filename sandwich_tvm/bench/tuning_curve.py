"""`python -m sandwich_tvm.bench tuning-curve`: tokens/s of a served model while background
tuning lands its records.

It starts ``serve --tune-in-background idle`` on a model whose GEMMs lack records (a fresh
records directory, the only one the server reads records from; the tuner's cost model and
transfer also learn from the package's shipped records unless ``--costmodel-data records``, and
``--copy-records DIR`` starts the directory as a copy of DIR, e.g. every shipped record but this
CPU's, to tune as on a new CPU), then sends the
same greedy request over and over, idling ``--idle`` seconds between requests (the worker tunes
only while the server is idle), until the worker has finished and ``--after`` requests have run
on its last build. Each request's TTFT and TPOT come from its token stream; the server's
``/metrics`` say how many GEMMs have landed and how many builds were swapped in. Requests skip
the prefix cache (``cache_prompt: false``), so each one computes the same way on the build it
runs on; the report counts the distinct greedy texts. A tuned kernel sums in another order than
the default one, so a real model's greedy text can part where two tokens are near a tie (the
exact check, on a tiny model, is ``tests/runtime/test_background_tuning.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_float, positive_int

METRICS = {"swaps": "sandwich_kernel_swaps_total", "landed": "sandwich_background_tuned_gemms_total",
           "running": "sandwich_background_tuning_running"}


def add_tuning_curve_parser(sub) -> None:
    from ..model.config import DEFAULT_MODEL

    p = sub.add_parser("tuning-curve", help="tokens/s of a served model as background tuning lands records")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model to serve (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="weights, as serve takes them (default auto)")
    p.add_argument("--records", type=Path, default=None,
                   help="records directory the server tunes into (default: a fresh temporary one)")
    p.add_argument("--copy-records", type=Path, default=None, metavar="DIR",
                   help="start the fresh records directory as a copy of DIR (default: empty)")
    p.add_argument("--costmodel-data", choices=("all", "records"), default="all",
                   help="serve --costmodel-data: records keeps the shipped records out of the tuner's cost "
                        "model and transfer (default all)")
    p.add_argument("--budget", type=positive_float, default=8.0, metavar="MIN",
                   help="serve --tune-budget (default 8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512,
                   help="prompt length: its TTFT times prefill (default 512)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="tokens per request (default 64)")
    p.add_argument("--idle", type=float, default=5.0, help="seconds idle between requests (default 5)")
    p.add_argument("--after", type=positive_int, default=5,
                   help="requests on the last build once tuning has ended (default 5)")
    p.add_argument("--timeout", type=positive_float, default=3600.0,
                   help="give up after this many seconds (default 3600)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here too")
    p.add_argument("--plot", type=Path, default=None, help="plot tokens/s against time to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def scrape(text: str) -> dict[str, float]:
    """The background-tuning values of a Prometheus exposition (0 where absent)."""
    from .serving.client import read_metrics

    return dict.fromkeys(METRICS, 0.0) | read_metrics(text, METRICS)


def stream_once(client: httpx.Client, base: str, body: dict) -> dict:
    """One streamed completion: its text, TTFT, TPOT (first to last token over tokens - 1)."""
    t0 = time.perf_counter()
    stamps, text, tokens = [], [], None
    with client.stream("POST", base + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("choices"):  # one chunk per token, its text possibly held back (UTF-8)
                stamps.append(time.perf_counter() - t0)
                text.append(obj["choices"][0].get("text") or "")
            if isinstance(obj.get("usage"), dict):
                tokens = obj["usage"].get("completion_tokens")
    tokens = tokens or len(stamps)
    if tokens < 2 or not stamps:
        raise RuntimeError("the server returned fewer than two tokens")
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1)
    return {"text": "".join(text), "ttft_ms": 1e3 * stamps[0], "tpot_ms": 1e3 * tpot,
            "tokens_per_s": 1.0 / tpot, "prefill_tokens_per_s": len(body["prompt"]) / stamps[0],
            "tokens": tokens}


def summarize(points: list[dict]) -> dict:
    """Requests before any swap (untuned) against the ones on the last build: medians of TPOT
    and tokens/s, their ratio, and how many greedy texts the requests gave. A request during
    which a build was swapped in counts for neither; with no untuned request there is no ratio."""
    steady = [p for p in points if not p.get("swapped_during")]  # one build from first to last token
    untuned = [p for p in steady if not p["swaps"]]
    tuned = [p for p in steady if p["after_tuning"]] or steady[-1:]

    def med(rows: list[dict], key: str) -> float | None:
        return float(np.median([p[key] for p in rows])) if rows else None

    def ratio(key: str) -> float | None:
        a, b = med(tuned, key), med(untuned, key)
        return None if a is None or b is None else a / b

    return {"untuned_tokens_per_s": med(untuned, "tokens_per_s"), "untuned_tpot_ms": med(untuned, "tpot_ms"),
            "untuned_requests": len(untuned), "tuned_tokens_per_s": med(tuned, "tokens_per_s"),
            "tuned_tpot_ms": med(tuned, "tpot_ms"), "tuned_requests": len(tuned),
            "speedup": ratio("tokens_per_s"),
            "untuned_prefill_tokens_per_s": med(untuned, "prefill_tokens_per_s"),
            "tuned_prefill_tokens_per_s": med(tuned, "prefill_tokens_per_s"),
            "prefill_speedup": ratio("prefill_tokens_per_s"),
            "swaps": points[-1]["swaps"], "gemms_landed": points[-1]["landed"],
            "distinct_texts": len({p["text"] for p in points}),
            "texts_by_swaps": {str(int(k)): len({p["text"] for p in points if p["swaps"] == k})
                               for k in sorted({p["swaps"] for p in points})}}


def plot_curve(points: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    t = [p["t_s"] for p in points]
    for ax, key, label in ((axes[0], "prefill_tokens_per_s", "prompt tokens/s (prompt / TTFT)"),
                           (axes[1], "tokens_per_s", "decode tokens/s (1 / TPOT)")):
        ax.plot(t, [p[key] for p in points], "o-", ms=3)
        for p, q in zip(points, points[1:], strict=False):
            if q["swaps"] > p["swaps"]:
                ax.axvline(q["t_s"], color="grey", lw=0.6, ls=":")
        ax.set_ylabel(label)
    axes[1].set_xlabel("seconds since the server answered (dotted: a tuned build swapped in before)")
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_tuning_curve(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..host import host_signature, save_atomic
    from ..model.tokenizer import load_model_tokenizer
    from .baselines.server_process import ServerProcess, ServerStartError, free_port
    from .perplexity import sharegpt_text

    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    if args.copy_records is not None and not args.copy_records.is_dir():
        print_error(console, ValueError(f"--copy-records {args.copy_records} is not a directory"))
        return 2
    records = args.records or Path(tempfile.mkdtemp(prefix="sandwich-records-"))
    if args.copy_records is not None:
        shutil.copytree(args.copy_records, records, dirs_exist_ok=True)
    try:
        tok = load_model_tokenizer(args.model)
    except (OSError, ValueError) as exc:
        print_error(console, exc)
        return 2
    ids = tok.encode(sharegpt_text(8 * args.prompt_tokens)) if tok else []
    prompt = (ids or list(range(1, args.prompt_tokens + 1)))[:args.prompt_tokens]
    body = {"model": "m", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_prompt": False}
    port = free_port()
    cmd = [sys.executable, "-m", "sandwich_tvm.serve", "--model", str(args.model), "--dtype", args.dtype,
           "--records", str(records), "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", "m", "--tune-in-background", "idle", "--tune-budget", str(args.budget),
           "--costmodel-data", args.costmodel_data]
    env = {**os.environ, "SANDWICH_RECORDS_DIR": str(records)}
    log_path = records / "serve.log"
    log(f"serving {args.model} with background tuning into {records} (log {log_path})")
    points: list[dict] = []
    try:
        with ServerProcess("sandwich", cmd, port, log_path=log_path, env=env) as srv, \
                httpx.Client(timeout=600) as client:
            t0, ended_at = time.monotonic(), None
            while time.monotonic() - t0 < args.timeout:
                before = scrape(client.get(srv.base_url + "/metrics").text)
                row = stream_once(client, srv.base_url, body)
                after = scrape(client.get(srv.base_url + "/metrics").text)
                row |= {"t_s": time.monotonic() - t0, **before, "after_tuning": ended_at is not None,
                        "swapped_during": after["swaps"] != before["swaps"]}
                points.append(row)
                log(f"t={row['t_s']:6.0f} s  {row['tokens_per_s']:7.1f} tokens/s  TPOT {row['tpot_ms']:.1f} "
                    f"ms  GEMMs landed {before['landed']:.0f}, builds swapped in {before['swaps']:.0f}")
                if ended_at is None and not before["running"] and (before["swaps"] or len(points) > 1):
                    ended_at = row["t_s"]  # the worker is gone: what follows runs on its last build
                    points[-1]["after_tuning"] = True
                if ended_at is not None and sum(p["after_tuning"] for p in points) >= args.after:
                    break
                time.sleep(args.idle)
            else:
                print_error(console, f"background tuning had not ended after {args.timeout:g} s")
                return 1
    except (ServerStartError, RuntimeError, httpx.HTTPError) as exc:
        print_error(console, exc)
        return 1
    cpu = host_signature()
    out = {"model": str(args.model), "dtype": args.dtype, "cpu": f"{cpu.model_name} ({cpu.slug})",
           "budget_min": args.budget, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
           "idle_s": args.idle, "records": str(records), "costmodel_data": args.costmodel_data,
           "copied_records": None if args.copy_records is None else str(args.copy_records),
           "points": points, "summary": summarize(points),
           "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["tuning-curve"]))}
    if args.out:
        save_atomic(args.out, json.dumps(out, indent=1))
    if args.plot:
        plot_curve(points, args.plot, f"{out['model']} on {out['cpu']}: serve --tune-in-background idle")
    s = out["summary"]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        table = Table(title=f"{out['model']} while background tuning lands records ({out['cpu']})")
        for col in ("t (s)", "GEMMs landed", "builds swapped in", "TTFT ms", "prompt tokens/s", "TPOT ms",
                    "tokens/s"):
            table.add_column(col)
        for p in points:
            table.add_row(f"{p['t_s']:.0f}", f"{p['landed']:.0f}", f"{p['swaps']:.0f}",
                          f"{p['ttft_ms']:.1f}", f"{p['prefill_tokens_per_s']:.0f}", f"{p['tpot_ms']:.2f}",
                          f"{p['tokens_per_s']:.1f}")
        console.print(table)
        if s["speedup"] is None:
            console.print("no request ran before the first swap: nothing untuned to compare with")
        else:
            console.print(f"prompt tokens/s {s['untuned_prefill_tokens_per_s']:.0f} untuned -> "
                          f"{s['tuned_prefill_tokens_per_s']:.0f} tuned ({s['prefill_speedup']:.2f}x); "
                          f"decode tokens/s {s['untuned_tokens_per_s']:.1f} -> {s['tuned_tokens_per_s']:.1f} "
                          f"({s['speedup']:.2f}x)")
        console.print(f"{s['distinct_texts']} distinct greedy text(s) over {len(points)} requests and "
                      f"{s['swaps']:.0f} swaps")
    return 0
