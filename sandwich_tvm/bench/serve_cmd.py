"""`python -m sandwich_tvm.bench serve`: the paper's serving benchmark (Sec. 8.3) over HTTP.

Every system is started as an OpenAI-compatible server (Sandwich's ``sandwich_tvm.serve``,
llama.cpp's ``llama-server`` on a GGUF of the same weights in the same dtype) and driven by the same
streaming client with the same token-id prompts. ``--mode single`` sends the requests one after
another (single-sequence serving); ``--mode poisson`` sends them at Poisson arrival times for
each ``--rates`` value (batched serving, open loop). Reported per rate: P50/P90/P99 TTFT, TPOT
and E2E, output tokens/s, SLO attainment; per system: goodput (the highest rate with 90%
attainment) and the SLO-scale sweep of Fig. 9. Results are saved after every rate.

llama-server runs twice: as its users start it (``llamacpp``: weights mmap-ed from the GGUF)
and with its weights locked in memory (``llamacpp-mlock``: ``--mlock --no-mmap``). The systems
take turns in ``--rounds`` rounds (A B, B A, ...), so their runs of a rate are paired; the JSON
lists the run order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from ..cli.args import non_negative_int, positive_int, threads_beyond_cpus
from ..cli.common import print_error
from ..kernels.attention import DEFAULT_KV_DTYPE, KV_DTYPES
from ..model.config import DEFAULT_MODEL, ModelConfigError, load_config
from ..spec import DEFAULT_DTYPE, WEIGHT_DTYPES, resolve_weight_dtype
from .serving.report import DEFAULT_SCALES, render, without_requests
from .serving.runner import SANDWICH_SYSTEMS, SYSTEMS, ServeBenchConfig, resolve_cpus, run_benchmark
from .serving.workload import parse_lengths

KNOWN_SYSTEMS = tuple(dict.fromkeys([*SYSTEMS, *SANDWICH_SYSTEMS]))

DEFAULT_RATES = "0.5,1,2,4"
DEFAULT_CONTEXT = 2048


def positive_float(text: str) -> float:
    """A number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not positive")
    return value


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serving benchmark over the OpenAI API: SLO attainment, goodput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", default=DEFAULT_MODEL, metavar="MODEL",
                   help=f"a packaged model (default {DEFAULT_MODEL}), a preset of random weights, an HF "
                        "model directory or a .gguf file")
    s.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated systems, taking turns (default {','.join(SYSTEMS)}; "
                        "llamacpp-mlock is llama-server with --mlock --no-mmap; both are skipped with "
                        "the reason when llama-server is unavailable; sandwich-mixed is Sandwich with "
                        "--step-policy mixed, sandwich-nocache with --no-prefix-caching, sandwich-spec "
                        "with 4 prompt-lookup draft tokens, sandwich-draft with 4 from --draft-model)")
    s.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="sandwich-draft's draft model (sharing the model's tokenizer)")
    s.add_argument("--draft-dtype", default="auto", help="the draft model's weight type (default auto)")
    s.add_argument("--rounds", type=positive_int, default=2,
                   help="whole sweeps per system, the systems taking turns round by round and the order "
                        "reversed every other round, so each round's runs of a rate pair up (default 2; "
                        "1: one system after another); each round sends --num-prompts per rate")
    s.add_argument("--mode", choices=["single", "poisson", "multiturn"], default="poisson",
                   help="single: one request after another; poisson: Poisson arrivals per rate (default); "
                        "multiturn: ShareGPT conversations arriving per rate, replayed turn by turn, each "
                        "turn's prompt carrying the history")
    s.add_argument("--rates", default=DEFAULT_RATES,
                   help=f"request (multiturn: conversation) rates per second (default {DEFAULT_RATES})")
    s.add_argument("--think-s", type=float, default=5.0,
                   help="multiturn: mean think time between an answer and the next turn, seconds (default 5)")
    s.add_argument("--max-turns", type=positive_int, default=4,
                   help="multiturn: turns per conversation at most (default 4)")
    s.add_argument("--num-prompts", type=positive_int, default=90,
                   help="requests per rate and round (default 90, as the paper's single-sequence runs); only "
                        "what is needed of ShareGPT is tokenized")
    s.add_argument("--duration", type=positive_float, default=None, metavar="S",
                   help="send no request later than S seconds into a rate (the rest count as not sent)")
    s.add_argument("--lengths", metavar="P:O,...", default=None,
                   help="fixed PROMPT:OUTPUT token lengths, cycled (default: ShareGPT, tokenized with the "
                        "model's tokenizer)")
    s.add_argument("--max-output", type=non_negative_int, default=256,
                   help="clip ShareGPT output lengths to this many tokens (default 256; 0: no clip)")
    s.add_argument("--slo-ttft", type=positive_float, default=None, metavar="MS",
                   help="TTFT SLO in ms (default: the paper's for the model size and mode: batched 160M "
                        "200, 1B-class 2000; single-sequence 1B-class 2200, 8B 8000)")
    s.add_argument("--slo-tpot", type=positive_float, default=None, metavar="MS",
                   help="TPOT SLO in ms (default: batched 160M 100, 1B-class 280; single-sequence "
                        "1B-class 70, 8B 240)")
    s.add_argument("--slo-scales", default=",".join(f"{x:g}" for x in DEFAULT_SCALES),
                   help="SLO scales of the sweep, both SLOs multiplied (default "
                        f"{','.join(f'{x:g}' for x in DEFAULT_SCALES)})")
    s.add_argument("--threads", type=positive_int, default=None,
                   help="threads of every server, each server pinned to the same CPUs: the first T this "
                        "process may use (default all), or with a Sandwich plan its CPUs (both phases)")
    s.add_argument("--max-batch", type=positive_int, default=8,
                   help="sequences served together (Sandwich --max-batch, llama-server slots; default 8)")
    s.add_argument("--plan", type=Path, default=None,
                   help="Sandwich's plans.json (default: every CPU)")
    s.add_argument("--context", type=positive_int, default=None,
                   help=f"tokens of one request, prompt + output (default min({DEFAULT_CONTEXT}, the "
                        "model's)); both systems' KV caches hold max-batch times it")
    s.add_argument("--prefill-budget", type=positive_int, default=512,
                   help="Sandwich's tokens per prefill iteration (its scheduler policy; default 512)")
    s.add_argument("--priority", choices=("prefill", "decode"), default="prefill",
                   help="Sandwich's phase when both have work (default prefill)")
    s.add_argument("--dtype", choices=("auto", *WEIGHT_DTYPES), default=DEFAULT_DTYPE,
                   help=f"both systems' weights (default {DEFAULT_DTYPE}; auto: bfloat16): Sandwich's "
                        "--dtype and an F32/F16/BF16 GGUF for llama-server")
    s.add_argument("--kv-dtype", choices=KV_DTYPES, default=DEFAULT_KV_DTYPE,
                   help=f"Sandwich's KV cache dtype (default {DEFAULT_KV_DTYPE}; llama-server's default is "
                        "f16)")
    s.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the sample, the arrivals and a preset's weights (default 0)")
    s.add_argument("--timeout", type=positive_float, default=600.0, metavar="S",
                   help="per-request timeout in seconds (default 600)")
    s.add_argument("--ready-timeout", type=positive_float, default=600.0, metavar="S",
                   help="seconds a server may take to answer /health (default 600)")
    s.add_argument("--out", type=Path, default=Path("out"),
                   help="directory of the JSON results, the PNG plot and the server logs (default out/)")
    s.add_argument("--json", action="store_true", help="print the JSON summary instead of tables")


def _numbers(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} {text!r}: write comma-separated numbers, e.g. 0.5,1,2") from None
    if not values:
        raise ValueError(f"{what} {text!r} names no value")
    if any(not v > 0 for v in values):
        raise ValueError(f"{what} {text!r}: every value must be positive")
    return tuple(sorted(set(values)))


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The validated configuration; ValueError (one line) for bad input."""
    systems = tuple(dict.fromkeys(x.strip() for x in args.systems.split(",") if x.strip()))
    unknown = [x for x in systems if x not in KNOWN_SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"--systems {args.systems!r}: unknown system {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(KNOWN_SYSTEMS)}")
    rates = _numbers(args.rates, "--rates")
    scales = _numbers(args.slo_scales, "--slo-scales")
    lengths = None if args.lengths is None else tuple(parse_lengths(args.lengths))
    model = load_config(args.model)
    context = args.context or min(DEFAULT_CONTEXT, model.max_position_embeddings)
    if context > model.max_position_embeddings:
        raise ValueError(f"--context {context} exceeds the {model.max_position_embeddings} positions of "
                         f"{model.name}")
    if args.think_s < 0:
        raise ValueError(f"--think-s {args.think_s}: a think time cannot be negative")
    if args.threads is not None and (too_many := threads_beyond_cpus(args.threads)):
        raise ValueError(too_many)
    if "sandwich-draft" in systems and not args.draft_model:
        raise ValueError("--systems names sandwich-draft: give its --draft-model MODEL")
    cpus, plan = resolve_cpus(systems, args.plan, args.threads)
    return ServeBenchConfig(
        model=args.model, systems=systems, mode=args.mode, rates=rates, num_prompts=args.num_prompts,
        think_s=args.think_s, max_turns=args.max_turns,
        duration_s=args.duration, lengths=lengths, max_output=args.max_output or None,
        slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot, slo_scales=scales, cpus=cpus,
        max_batch=args.max_batch, plan=plan, context=context, seed=args.seed, out=args.out,
        rounds=args.rounds,
        kv_dtype=args.kv_dtype, prefill_budget=args.prefill_budget, priority=args.priority,
        dtype=resolve_weight_dtype(args.dtype)[0], draft_model=args.draft_model, draft_dtype=args.draft_dtype,
        timeout_s=args.timeout, ready_timeout_s=args.ready_timeout)


def main_serve(args: argparse.Namespace, console: Console) -> int:
    try:
        cfg = config_from_args(args)
    except (ValueError, ModelConfigError) as err:
        print_error(console, err)
        return 2
    if cfg.mode == "single" and args.rates != DEFAULT_RATES:
        console.print("note: --rates is ignored in --mode single", markup=False)
    model = load_config(cfg.model)

    def log(msg: str) -> None:
        console.print(msg, markup=False, highlight=False, soft_wrap=True)

    try:
        doc = run_benchmark(cfg, model, log)
    except ValueError as err:
        print_error(console, err)
        return 2
    stem = cfg.out / cfg.stem(model)
    if args.json:
        print(json.dumps(without_requests(doc), indent=1))
    else:
        render(doc, console)
    console.print(f"results {stem}.json (with per-request records), plot {stem}.png", markup=False)
    return 0 if any(s["status"] == "ok" for s in doc["systems"].values()) else 1
