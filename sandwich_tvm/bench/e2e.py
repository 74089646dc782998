"""`python -m sandwich_tvm.bench e2e`: TTFT and TPOT of the whole model, Sandwich against baselines.

Each of ``--repeat`` rounds runs one whole request (prefill, then the greedy tokens) per system;
TTFT and TPOT (the median decode step of a request) are medians over the rounds. Sandwich,
llama.cpp and torch take turns in every round (``bench/rounds.py``), and their ratios are the
median of the per-round ratios, so the host's memory-bandwidth drift (minutes long, up to ~1.7x
here) cancels out; the JSON's ``order`` lists the requests as they ran. Every system's weights
stay loaded for the whole run.
Systems, each on the same thread count and the same weights: Sandwich (the plan's prefill and
decode cores, hot switching), HF ``transformers`` on torch, TVM's stock Relax build (its
unscheduled loops are ~100x slower, so it runs only prompts up to ``--stock-max-prompt``, after
the others) and llama.cpp when ``llama_cpp`` and ``gguf`` are installed: ``llamacpp`` with its
defaults (weights mmap-ed from the GGUF) and ``llamacpp-mlock`` with its weights read into
locked memory (``use_mlock``, ``use_mmap=False``), so the page size's part shows. The
simulator's predictions for the plan are printed next to the measured Sandwich numbers; its TPOT
uses the memory bandwidth sampled before and after each of that prompt length's Sandwich
requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.common import print_error
from ..cli.options import add_model_args, spec_from_args, synthetic_prompt
from ..host import cpu_flags, host_isa, host_signature, last_level_cache_bytes
from ..kernels.microkernel import ISAS, kernel_isa
from ..kernels.quant import head_dtype
from ..model.config import LlamaConfig
from ..model.rope import stock_problem
from ..spec import DTYPE_BYTES, RunSpec, kv_value_bytes, layer_weight_bytes, resolve_activations
from ..topology.simulator import measured_decode_kernels
from .baselines.torch_hf import hf_model, torch_dtype, torch_runner
from .rounds import Runner, interleaved, merge_rounds, paired_ratio

SYSTEMS = ("sandwich", "llamacpp", "llamacpp-mlock", "torch", "stock")
LLAMACPP_ROWS = {"llamacpp": "llama.cpp", "llamacpp-mlock": "llama.cpp mlock"}  # system -> row name
# Sandwich's rows get ratios to these rows: (row name, the keys' suffix)
RATIO_TAGS = (("torch", "torch"), ("llama.cpp", "llamacpp"), ("llama.cpp mlock", "llamacpp_mlock"))


def add_e2e_parser(sub) -> None:
    e = sub.add_parser("e2e", help="TTFT / TPOT of the whole model against baselines")
    add_model_args(e)
    e.add_argument("--prompts", default="128,512,1024", help="prompt lengths (default 128,512,1024)")
    e.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per request (default 128)")
    e.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated: {', '.join(SYSTEMS)} (default all; llamacpp-mlock is llama.cpp "
                        "with its weights locked in memory; both are skipped with a note when the extra "
                        "is not installed)")
    e.add_argument("--repeat", type=int, default=3,
                   help="requests per prompt length and system; medians over them (default 3; TVM stock: 1)")
    e.add_argument("--stock-max-prompt", type=int, default=128,
                   help="longest prompt given to TVM's stock build (default 128)")
    e.add_argument("--cached-profile", action="store_true",
                   help="predict from the cached machine profile instead of re-measuring it in this run "
                        "(memory bandwidth drifts: the default measures it right after the timed requests)")
    e.add_argument("--torch-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="dtype of the torch baseline (default auto: bfloat16 where the CPU has AMX or "
                        "AVX512-BF16, as its users would run it; float32 elsewhere)")
    e.add_argument("--also-plan", type=Path, default=None, metavar="FILE",
                   help="also run Sandwich on this plans.json (e.g. two processes against one), its "
                        "requests interleaved with the main plan's; rows 'sandwich tpP' (or ppS), with "
                        "ratios to 'sandwich' and the simulator's predictions for that plan")
    e.add_argument("--also-dtype", choices=["float32", "bfloat16", "float16", "q8_0", "q4_0", "q4_1"],
                   default=None,
                   help="also run Sandwich with this weight dtype on the main plan (e.g. float32 against "
                        "bf16), its requests interleaved with the main run's; rows 'sandwich DTYPE', with "
                        "ratios to 'sandwich'")
    e.add_argument("--also-activations", choices=["int8", "float32"], default=None,
                   help="also run Sandwich's quantized weights with these activations (int8 dot "
                        "products, or the weights dequantized in registers), interleaved")
    e.add_argument("--also-records", type=Path, default=None, metavar="DIR",
                   help="also run Sandwich on the kernel records in DIR (e.g. a new tuning against the "
                        "shipped records), its requests interleaved with the main run's; rows 'sandwich "
                        "records', with ratios to 'sandwich'")
    e.add_argument("--llamacpp-dtype", choices=["float32", "bfloat16", "float16", "q8_0", "q4_0", "q4_1"],
                   default=None,
                   help="the GGUF llama.cpp runs (default: the precision Sandwich runs, --dtype), e.g. "
                        "float16 against a bfloat16 Sandwich where F16 is llama.cpp's faster 16-bit type")
    e.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    e.add_argument("--plot", type=Path, default=Path("out/bench_e2e.png"), help="PNG plot path")


def tvm_runner(args, spec: RunSpec, prompts: list[int], log, probe=None, name: str = "sandwich") -> Runner:
    """Requests on the engine of ``spec`` (Sandwich's, or TVM's stock build)."""
    from ..runtime.loader import open_engine

    cfg, stock, dtype = spec.config, spec.stock, spec.weight_dtype
    engine, _ = open_engine(spec, log=log)
    engine.generate(synthetic_prompt(8, cfg.vocab_size), 4)  # warm-up: pages, thread pool

    def run(p: int) -> dict | None:
        if stock and p > args.stock_max_prompt:
            return None
        new = args.new_tokens if not stock else min(args.new_tokens, 16)
        if probe is not None:
            probe.sample()
        gen = engine.generate(synthetic_prompt(p, cfg.vocab_size), new)
        if probe is not None:  # the bandwidth of the minutes this request decoded in
            probe.sample()
        decode_total = sum(gen.decode_ms)
        row = {"system": "tvm-stock" if stock else name, "prompt": p, "weights": dtype,
               "wider_linears": len(spec.built_wider),
               "ttft_ms": gen.ttft_ms,
               "tpot_ms": gen.to_json()["tpot_ms"], "output_tokens": len(gen.tokens),
               "switch_ms": gen.switch_ms,
               "tokens": gen.tokens[:16], "weights_huge_page_share": engine.huge_page_share,
               "switch_share_of_decode": gen.switch_ms / decode_total if decode_total else None}
        log(f"{row['system']}: prompt {p}: TTFT {row['ttft_ms']:.0f} ms, TPOT {row['tpot_ms'] or 0:.2f} ms")
        return row

    return run


def torch_baseline(args, cfg: LlamaConfig, threads: int, log) -> Runner:
    """HF transformers as ``generate`` runs it, in the dtype its users would pick on this CPU."""
    import torch

    dtype, why = torch_dtype(getattr(args, "torch_dtype", "auto"))
    log(f"torch baseline: {dtype} ({why}), logits of the last position only, {threads} threads")
    model = hf_model(args.model, cfg, args.seed).to(getattr(torch, dtype))
    run = torch_runner(model, dtype, threads, args.new_tokens, lambda p: synthetic_prompt(p, cfg.vocab_size))

    def logged(p: int) -> dict:
        row = run(p)
        log(f"torch: prompt {p}: TTFT {row['ttft_ms']:.0f} ms, TPOT {row['tpot_ms']:.2f} ms")
        return row

    return logged


def llamacpp_runner(args, cfg: LlamaConfig, prompts: list[int], threads: int, notes: list[str],
                    log, weight_dtype: str, locked: bool = False) -> Runner | None:
    """llama.cpp through llama-cpp-python; ``locked``: its weights in locked memory."""
    import os

    from ..model.config import model_path
    from ..model.gguf import layer_kinds
    from ..tvm_compat import PROCESS_CPUS
    from .baselines.llamacpp import LlamaCpp, available, gguf_for

    why = available()
    if why:
        if why not in notes:  # once for both llama.cpp rows
            notes.append(why)
        return None
    os.sched_setaffinity(0, PROCESS_CPUS)
    # the weights in the precision Sandwich runs them (F32, or an F16/BF16 GGUF)
    dtype = args.llamacpp_dtype or weight_dtype
    path = gguf_for(args.model, cfg, args.seed, log=log, dtype=dtype)
    kinds = layer_kinds(path) if path == model_path(args.model) else None
    own = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype.upper())
    if kinds and set(kinds) != {own}:  # the user's own file in other types (Q4_K_M): named by them
        dtype = "GGUF " + "/".join(kind for kind, _ in kinds.most_common())
    # our context (llama.cpp rounds it up to 256): LongRoPE's set, chosen by it, is the same
    context = max(prompts) + args.new_tokens + 1
    if cfg.sliding_window and context > cfg.sliding_window and "window" not in " ".join(notes):
        notes.append(f"llama.cpp attends to every key: its GGUF of this model holds no sliding window, "
                     f"which Sandwich applies ({cfg.sliding_window} positions, under the context {context})")
    engine = LlamaCpp(path, threads, context=context, locked=locked)
    engine.generate(synthetic_prompt(8, cfg.vocab_size), 3)  # warm-up
    name = LLAMACPP_ROWS["llamacpp-mlock" if locked else "llamacpp"]
    memory = ({"weights_memory": "locked (use_mlock, use_mmap=False)", "memlock_limit": engine.memlock_limit}
              if locked else {"weights_memory": "mmap (llama.cpp's default)"})

    def run(p: int) -> dict:
        os.sched_setaffinity(0, PROCESS_CPUS)  # its threads inherit this thread's CPUs
        ttft, steps, tokens = engine.generate(synthetic_prompt(p, cfg.vocab_size), args.new_tokens)
        row = {"system": name, "prompt": p, "weights": dtype, "ttft_ms": ttft,
               "tpot_ms": float(np.median(steps)),
               "output_tokens": len(tokens), "tokens": tokens[:16], **memory}
        log(f"{name}: prompt {p}: TTFT {row['ttft_ms']:.0f} ms, TPOT {row['tpot_ms']:.2f} ms")
        return row

    return run


def predicted(cfg: LlamaConfig, plan, prompts: list[int], new_tokens: int, log,
              refresh: bool = True, decode_gbs: dict[int, float] | None = None,
              gemm_speedup: float = 1.0, weight_bytes: float = 4, kv_bytes: float = 4,
              kernels: dict | None = None, head_bytes: float | None = None) -> list[dict]:
    """The simulator's TTFT/TPOT for the plan on this machine: its profile (measured now when
    ``refresh``), for each prompt length the memory-bandwidth curve scaled to ``decode_gbs[p]``
    on the decode cores when given (the bandwidth sampled around that length's requests).
    ``gemm_speedup``: the Linear layers' compute roof over the measured fp32 one (2 for bf16
    pairs on vdpbf16ps, which does two k steps per instruction; attention stays fp32);
    ``kernels``: the decode GEMMs' measured times per thread count (``measured_decode_kernels``)."""
    from ..topology import load_tree
    from ..topology.configs import ServiceConfig
    from ..topology.microbench import measure_profile
    from ..topology.simulator import LatencySimulator, Trace

    tree, found = load_tree()
    measured = measure_profile(tree, found.cpu_model, refresh=refresh, log=log)
    measured = dataclasses.replace(measured, gemm_efficiency=measured.gemm_efficiency * gemm_speedup)
    procs = len(plan.ranks)  # the all-reduce of TP ranks, or the hand-offs of pipeline stages
    allreduce = allreduce_profile(procs, cfg.hidden_size, log) if procs > 1 else {}
    if allreduce:  # the all-reduce the ranks run, measured between as many processes
        measured = dataclasses.replace(measured, **allreduce)
    where = dict(zip(tree.pus, tree.domains, strict=True))

    def config(cpus: list[tuple[int, ...]]) -> ServiceConfig:
        return ServiceConfig(tuple(cpus), tuple(tuple(sorted({where[c] for c in p})) for p in cpus), plan.pp,
                             wa=plan.wa)

    pre, dec = config([p for p, _ in plan.ranks]), config([d for _, d in plan.ranks])
    out = []
    for n in prompts:
        gbs = (decode_gbs or {}).get(n)
        profile = measured if gbs is None else with_bandwidth(measured, len(plan.all_decode_cpus), gbs)
        p = np.array([n], dtype=float)
        sim = LatencySimulator(tree, profile, cfg, Trace(prompt=p, output=np.full_like(p, new_tokens)),
                               weight_bytes=weight_bytes, kv_bytes=kv_bytes, decode_kernels=kernels,
                               head_bytes=head_bytes)
        out.append({"prompt": n, "ttft_ms": float(sim.ttft_ms(pre, p)[0]),
                    "tpot_ms": float(sim.tpot_ms(dec, p + new_tokens / 2)[0]), "decode_gbs": gbs,
                    "llc_roof_gbs": measured.llc_gbs_per_core * len(plan.all_decode_cpus), **allreduce})
    return out


def allreduce_profile(procs: int, hidden: int, log) -> dict:
    """The simulator's all-reduce terms from the shared-memory all-reduce timed now between
    ``procs`` processes: the latency of one token's hidden state and the bus bandwidth of a
    prefill-sized message (2 (P - 1) / P x bytes / time)."""
    from .allreduce import run_shm

    big = 1 << 20
    t = run_shm(procs, [hidden, big], rounds=3)
    gbs = 2 * (procs - 1) / procs * 4 * big / t[big] / 1e9
    log(f"all-reduce between {procs} processes: {t[hidden] * 1e6:.1f} µs for {hidden} floats, "
        f"{gbs:.1f} GB/s bus bandwidth at 4 MB")
    return {"allreduce_latency_us": t[hidden] * 1e6, "allreduce_gbs": gbs}


def with_bandwidth(profile, cores: int, gbs: float):
    """``profile`` with every memory resource's curve scaled so ``cores`` cores read ``gbs``."""
    from dataclasses import replace

    def scaled(r):
        factor = gbs / r.bandwidth(cores)
        return replace(r, bw_gbs=tuple(round(b * factor, 2) for b in r.bw_gbs))

    return replace(profile, resources=tuple(scaled(r) for r in profile.resources))


def bench_e2e(args, console: Console) -> dict:
    from ..topology.plan import ExecPlan

    if args.also_records is not None and not args.also_records.is_dir():
        raise SystemExit(f"--also-records {args.also_records}: no such directory of kernel records")
    prompts = [int(x) for x in args.prompts.split(",")]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    also_given = [f"--{n.replace('_', '-')}" for n in ("also_plan", "also_dtype", "also_activations",
                                                        "also_records")
                  if getattr(args, n) is not None]
    if also_given and "sandwich" not in systems:
        raise SystemExit(f"{', '.join(also_given)} runs against Sandwich's main run: add sandwich to "
                         "--systems")
    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    context = max(prompts) + args.new_tokens + 1
    spec = spec_from_args(args, log, context=context, prefill_chunk=context)
    cfg, plan = spec.config, spec.plan
    log(plan.describe())
    threads = len(plan.all_prefill_cpus)  # every system gets the plan's cores
    rows: list[dict] = []
    notes: list[str] = []
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}")
    if "stock" in systems and (kind := stock_problem(cfg)):
        systems.remove("stock")
        notes.append(f"TVM's stock build left out: {kind}")
    # Every system but the stock build takes its turn in each round (bench/rounds.py): decode is
    # bound by memory bandwidth the VM shares with its host, which drifts over minutes.
    runners: list[tuple[str, Runner | None]] = []
    probe = None
    if "sandwich" in systems:
        from ..topology.microbench import BandwidthProbe

        probe = BandwidthProbe(list(plan.all_decode_cpus))
        runners.append(("sandwich", tvm_runner(args, spec, prompts, log, probe)))
    # Sandwich's other runs, each paired with the main one: row name -> its spec
    variants: dict[str, RunSpec] = {}
    also = ExecPlan.from_file(args.also_plan) if args.also_plan is not None else None
    if also is not None:
        log(f"also: {also.describe()}")
        name = ("sandwich wa" if also.wa else f"sandwich tp{also.tp}" if also.pp == 1
                else f"sandwich pp{also.pp}")
        variants[name] = spec.with_plan(also)
    if args.also_dtype:  # every Linear in that type
        variants[f"sandwich {args.also_dtype}"] = dataclasses.replace(spec, weight_dtype=args.also_dtype,
                                                                       wider_linears=())
    if args.also_activations is not None:
        int8 = resolve_activations(args.also_activations, spec.weight_dtype)
        variants[f"sandwich {args.also_activations} activations"] = dataclasses.replace(
            spec, int8_activations=int8)
    if args.also_records is not None:
        variants["sandwich records"] = dataclasses.replace(spec, records=args.also_records)
    runners += [(name, tvm_runner(args, other, prompts, log, name=name)) for name, other in variants.items()]
    for system, row_name in LLAMACPP_ROWS.items():
        if system in systems:
            run = llamacpp_runner(args, cfg, prompts, threads, notes, log, spec.weight_dtype,
                                  locked=system == "llamacpp-mlock")
            runners.append((row_name, run))
    if "torch" in systems:
        runners.append(("torch", torch_baseline(args, cfg, threads, log)))
    turns = [(name, run) for name, run in runners if run is not None]
    gbs: dict[int, float] = {}
    order: list[dict] = []
    for i, p in enumerate(prompts):
        first = len(probe.samples) if probe is not None else 0
        rows += interleaved(turns, p, i, args.repeat, order)
        if probe is not None and probe.samples[first:]:  # the minutes this length decoded in
            gbs[p] = float(np.median(probe.samples[first:]))
    # the simulator streams the weights in the dtype Sandwich ran, at its kernels' compute roof

    def predict(run: RunSpec, refresh: bool = False) -> list[dict]:
        dtype, on = run.weight_dtype, run.plan
        pairs = ISAS[kernel_isa(host_isa(), dtype, cpu_flags())].k_pack
        kernels = measured_decode_kernels(cfg, dtype, {len(d) for _, d in on.ranks}, run.records)
        return predicted(cfg, on, prompts, args.new_tokens, log, refresh=refresh, decode_gbs=gbs,
                         gemm_speedup=float(pairs),
                         weight_bytes=layer_weight_bytes(cfg, dtype, run.wider_linears),
                         head_bytes=DTYPE_BYTES[head_dtype(dtype)],
                         kv_bytes=kv_value_bytes(spec.kv_dtype, spec.config.head_dim), kernels=kernels)

    preds = {"sandwich": predict(spec, refresh=not args.cached_profile)}
    preds.update({name: predict(other) for name, other in variants.items()})
    del runners, turns
    gc.collect()  # free those weights before the stock build's (Llama-3.2-1B is 5 GB in fp32)
    if "stock" in systems:
        stock_spec = dataclasses.replace(spec, stock=True, weight_dtype="float32", kv_dtype="float32",
                                         plan=plan.one_process())
        stock = tvm_runner(args, stock_spec, prompts, log)
        rows += [merge_rounds([row]) for p in prompts if (row := stock(p)) is not None]
    for r in rows:
        if r["system"] == "sandwich":
            for other, tag in RATIO_TAGS:
                base = next((b for b in rows if b["system"] == other and b["prompt"] == r["prompt"]), None)
                if base:
                    r[f"ttft_ratio_vs_{tag}"] = paired_ratio(r, base, "ttft")
                    r[f"tpot_ratio_vs_{tag}"] = paired_ratio(r, base, "tpot")
                    if "tokens" in base:
                        r[f"same_tokens_as_{tag}"] = r["tokens"] == base["tokens"]
        source = preds.get(r["system"])
        if source:
            pr = next(x for x in source if x["prompt"] == r["prompt"])
            r["predicted_ttft_ms"], r["predicted_tpot_ms"] = pr["ttft_ms"], pr["tpot_ms"]
            r["decode_bandwidth_gbs"], r["llc_roof_gbs"] = pr["decode_gbs"], pr.get("llc_roof_gbs")
            if "allreduce_latency_us" in pr:  # the simulator's all-reduce terms, timed in this run
                r["predicted_allreduce_us"] = pr["allreduce_latency_us"]
                r["predicted_allreduce_gbs"] = pr["allreduce_gbs"]
        if r["system"] in variants:
            base = next(b for b in rows if b["system"] == "sandwich" and b["prompt"] == r["prompt"])
            r["ttft_ratio_vs_sandwich"] = paired_ratio(r, base, "ttft")
            r["tpot_ratio_vs_sandwich"] = paired_ratio(r, base, "tpot")
            r["same_tokens_as_sandwich"] = r["tokens"] == base["tokens"]
    add_weight_reads(rows, cfg, spec.weight_dtype, spec.wider_linears)
    cpu = host_signature()
    return {"cpu": f"{cpu.model_name} ({cpu.slug})", "signature": cpu.to_json(),
            "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["e2e"])),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "model": cfg.name, "plan": plan.describe(),
            "threads": threads, "processes": plan.processes,
            "also_plan": also.describe() if also is not None else None, "also_dtype": args.also_dtype,
            "also_activations": args.also_activations,
            "also_records": None if args.also_records is None else str(args.also_records),
            "dtype": spec.weight_dtype, "kv_dtype": spec.kv_dtype,
            "wider_linears": [list(w) for w in spec.wider_linears],  # (layer, Linear, dtype) held wider
            "new_tokens": args.new_tokens, "rows": rows, "notes": notes, "repeat": max(1, args.repeat),
            "interleaving": "every round runs one request per system but the stock build, in turn; the "
                            "order is reversed every other round and prompt length", "order": order,
            "bandwidth_samples_gbs": probe.samples if probe else []}


def decode_weight_bytes(cfg: LlamaConfig, dtype: str, wider: tuple[tuple[int, str, str], ...] = ()) -> float:
    """Bytes of weights one decode step reads: every layer's Linears in ``dtype`` (quantized:
    with their blocks' scales; ``wider``: the ones held in another type, ``RunSpec.wider_linears``)
    and the head in its own type (q8_0 under 4-bit weights)."""
    head = cfg.vocab_size * cfg.hidden_size * DTYPE_BYTES[head_dtype(dtype)]
    return cfg.num_hidden_layers * cfg.layer_params() * layer_weight_bytes(cfg, dtype, wider) + head


def add_weight_reads(rows: list[dict], cfg: LlamaConfig, dtype: str,
                     wider: tuple[tuple[int, str, str], ...] = ()) -> None:
    """Each row's ``weight_read_gbs``: the decode step's weight bytes over its median TPOT (the
    KV cache and activations it also reads are left out, so this is a floor); Sandwich's rows
    also get that over the streaming-read (DRAM) bandwidth sampled around their requests, and
    which level served the weights: DRAM when they do not fit the last-level cache, the LLC when
    they fit it and were read faster than DRAM streams (else the run cannot tell)."""
    llc = last_level_cache_bytes()
    for r in rows:
        if not r.get("tpot_ms"):
            continue
        r_dtype = r.get("weights", dtype)
        if r_dtype not in DTYPE_BYTES:
            continue
        nbytes = decode_weight_bytes(cfg, r_dtype, wider if r.get("wider_linears") else ())
        r["weight_bytes"], r["llc_bytes"] = nbytes, llc
        r["weight_read_gbs"] = nbytes / (r["tpot_ms"] * 1e6)
        if r.get("decode_bandwidth_gbs"):
            r["weight_read_vs_stream"] = r["weight_read_gbs"] / r["decode_bandwidth_gbs"]
            above = r["weight_read_vs_stream"] > 1
            r["weights_served_from"] = ("DRAM" if nbytes > llc else "last-level cache" if above else
                                        "undetermined: they fit the last-level cache, but decode read "
                                        "them slower than DRAM streams")


def print_e2e(result: dict, console: Console) -> None:
    table = Table(title=f"{result['model']}: {result['plan']}")
    for col in ("system", "prompt", "TTFT ms", "TPOT ms", "TTFT / torch", "TPOT / torch",
                "TTFT / llama.cpp", "TPOT / llama.cpp", "TTFT / llama.cpp mlock", "TPOT / llama.cpp mlock",
                "predicted TTFT", "predicted TPOT", "switch µs"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        def f(key: str, fmt: str = "{:.1f}", r=r) -> str:
            return fmt.format(r[key]) if r.get(key) is not None else "-"
        system = r["system"] + (f" ({r['dtype']})" if "dtype" in r else "")
        table.add_row(system, str(r["prompt"]), f("ttft_ms"), f("tpot_ms", "{:.2f}"),
                      f("ttft_ratio_vs_torch", "{:.3f}"), f("tpot_ratio_vs_torch", "{:.3f}"),
                      f("ttft_ratio_vs_llamacpp", "{:.3f}"), f("tpot_ratio_vs_llamacpp", "{:.3f}"),
                      f("ttft_ratio_vs_llamacpp_mlock", "{:.3f}"),
                      f("tpot_ratio_vs_llamacpp_mlock", "{:.3f}"),
                      f("predicted_ttft_ms"), f("predicted_tpot_ms", "{:.2f}"),
                      "-" if r.get("switch_ms") is None else f"{r['switch_ms'] * 1e3:.0f}")
    console.print(table)
    for r in result["rows"]:
        if r.get("tpot_ratio_vs_sandwich") is not None:
            plan_row = r["system"].split()[-1][:2] in ("tp", "pp", "wa")
            what = result["also_plan"] if plan_row else r.get("weights")
            console.print(f"{r['system']} ({what}) at {r['prompt']} tokens: TTFT "
                          f"{r['ttft_ratio_vs_sandwich']:.3f}x, TPOT {r['tpot_ratio_vs_sandwich']:.3f}x "
                          f"the main run's (paired medians); same tokens: {r['same_tokens_as_sandwich']}")
    for r in result["rows"]:
        if r.get("weight_read_vs_stream") is not None:
            console.print(f"{r['system']} at {r['prompt']} tokens reads its {r['weight_bytes'] / 1e6:.0f} MB "
                          f"of weights at {r['weight_read_gbs']:.1f} "
                          f"GB/s while decoding: {r['weight_read_vs_stream']:.2f}x the streaming-read "
                          f"bandwidth sampled around its requests ({r['decode_bandwidth_gbs']:.1f} GB/s; "
                          f"LLC roof {r.get('llc_roof_gbs') or 0:.1f} GB/s): served from "
                          f"{r['weights_served_from']}")
    for n in result["notes"]:
        console.print(n)


def plot_e2e(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r["system"] for r in result["rows"]):
        rs = [r for r in result["rows"] if r["system"] == system]
        a.plot([r["prompt"] for r in rs], [r["ttft_ms"] for r in rs], "o-", label=system)
        b.plot([r["prompt"] for r in rs], [r["tpot_ms"] for r in rs], "o-", label=system)
    for ax, name in ((a, "TTFT ms"), (b, "TPOT ms")):
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"{result['model']} ({result['threads']} threads)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main_e2e(args: argparse.Namespace, console: Console) -> int:
    from ..cli.options import LOAD_ERRORS

    try:
        result = bench_e2e(args, console)
    except LOAD_ERRORS as exc:
        print_error(console, exc)
        return 2
    plot_e2e(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_e2e(result, console)
        console.print(f"plot: {args.plot}")
    return 0
