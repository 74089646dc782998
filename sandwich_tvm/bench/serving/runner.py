"""Drive the serving benchmark in rounds: in each round every system in turn starts its server,
warms it up, runs every request rate through the same client and stops; the report is saved
after every rate.

Systems never run concurrently (they would share the cores and the memory). They take turns
round by round, the order reversed every other round (A B, B A, A B, ...), so both systems'
runs of a rate are spread over the same minutes and neither always goes first: the host's
drift falls on both alike, and each round's runs pair up (``paired`` in the report). The report
records the run order (``order``). A system that cannot run (no ``llama-server`` binary, a server
that does not start) is reported with the reason and the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

from ...model.config import LlamaConfig
from ..baselines.server_process import ServerProcess, ServerStartError, free_port
from .client import RunResult, read_metrics, run_requests, warm_up
from .report import (
    DEFAULT_SCALES,
    Slo,
    SystemRuns,
    attainment,
    build_report,
    default_slo,
    percentiles,
    plot_report,
    save_report,
)
from .workload import Request, fixed_requests, sharegpt_conversations, sharegpt_requests

# llamacpp: llama-server as its users start it (weights mmap-ed from the GGUF, in the page
# cache's 4 KiB pages); llamacpp-mlock: the same with --mlock --no-mmap (weights read into
# memory it allocates and locks), so what the page size is worth shows as a second row.
SYSTEMS = ("sandwich", "llamacpp", "llamacpp-mlock")
# Sandwich variants, asked for by name: mixed steps, no prefix caching, speculative decoding with
# prompt lookup or with ``--draft-model`` (the server's options).
SPECULATIVE_TOKENS = 4
SANDWICH_SYSTEMS = {"sandwich": [], "sandwich-mixed": ["--step-policy", "mixed"],
                    "sandwich-nocache": ["--no-prefix-caching"],
                    "sandwich-spec": ["--num-speculative-tokens", str(SPECULATIVE_TOKENS)],
                    "sandwich-draft": ["--num-speculative-tokens", str(SPECULATIVE_TOKENS)]}
# The server's speculative counters (``/metrics``), read after every run of a Sandwich system.
SPEC_COUNTERS = {"drafted": "sandwich_spec_decode_num_draft_tokens_total",
                 "accepted": "sandwich_spec_decode_num_accepted_tokens_total",
                 "verified_steps": "sandwich_spec_decode_num_drafts_total",
                 "draft_s": "sandwich_spec_decode_draft_seconds_total"}
LLAMA_SERVER_SYSTEMS = {"llamacpp": False, "llamacpp-mlock": True}  # name -> weights locked
Log = Callable[[str], None]
# (system, command, port, environment, log file) -> a context manager yielding the base URL
Launcher = Callable[[str, list[str], int, dict[str, str], Path], AbstractContextManager[str]]


class SystemUnavailable(RuntimeError):
    """A system that cannot be benchmarked here; the message says why."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything one ``bench serve`` run needs (the CLI's options, validated)."""

    model: str
    systems: tuple[str, ...] = SYSTEMS
    mode: str = "poisson"
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    num_prompts: int = 90
    duration_s: float | None = None
    lengths: tuple[tuple[int, int], ...] | None = None
    max_output: int | None = 256
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_scales: tuple[float, ...] = DEFAULT_SCALES
    cpus: tuple[int, ...] = (0,)  # every server runs on exactly these CPUs, one thread each
    max_batch: int = 8
    plan: Path | None = None
    context: int = 2048  # tokens of one sequence (prompt + output)
    seed: int = 0
    rounds: int = 2  # whole sweeps per system, the systems taking turns (see the module docstring)
    kv_dtype: str = "float16"  # Sandwich's KV cache (llama-server's default is f16 too)
    dtype: str = "float32"  # the weights of both systems (llama-server: an F16/BF16 GGUF)
    think_s: float = 5.0  # multiturn: mean think time between a turn's answer and the next turn
    max_turns: int = 4  # multiturn: turns per conversation at most
    prefill_budget: int = 512  # Sandwich's SchedulerPolicy
    priority: str = "prefill"
    draft_model: str | None = None  # sandwich-draft's --draft-model
    draft_dtype: str = "auto"
    out: Path = Path("out")
    timeout_s: float = 600.0
    ready_timeout_s: float = 600.0

    def slo(self, model: LlamaConfig) -> tuple[Slo, str]:
        """The --slo-* values, each defaulting to the paper's for this model size and mode."""
        slo, source = default_slo(model.num_params(), self.mode)
        if self.slo_ttft_ms is None and self.slo_tpot_ms is None:
            return slo, source
        both = self.slo_ttft_ms is not None and self.slo_tpot_ms is not None
        return (Slo(self.slo_ttft_ms or slo.ttft_ms, self.slo_tpot_ms or slo.tpot_ms),
                "--slo-ttft/--slo-tpot" + ("" if both else f", else {source}"))

    @property
    def threads(self) -> int:
        return len(self.cpus)

    def stem(self, model: LlamaConfig) -> str:
        return f"serve_{_slug(model.name)}_{self.mode}"

    def kv_tokens(self) -> int:
        """The KV cache every system gets: ``max_batch`` full sequences (llama-server splits its
        ``-c`` over its slots; Sandwich's paged cache is shared by the running sequences)."""
        return self.max_batch * self.context


Cpus = tuple[int, ...]


def resolve_cpus(systems: tuple[str, ...], plan: Path | None,
                 threads: int | None) -> tuple[Cpus, Path | None]:
    """The CPUs every server gets, and the plan file Sandwich follows (None: all its CPUs).

    With a plan file (``--plan``, which the server is given too) the comparison runs on the
    plan's CPUs, both phases together; else on the first ``threads``
    CPUs this process may use. ValueError when ``threads`` contradicts the plan.
    """
    from ...host import PROCESS_CPUS

    usable = tuple(sorted(PROCESS_CPUS))
    if any(name in SANDWICH_SYSTEMS for name in systems):
        from ...topology.plan import ExecPlan, PlanError

        try:
            found = ExecPlan.from_file(plan) if plan is not None else None
        except PlanError as err:
            raise ValueError(str(err)) from None
        if found is not None:
            cpus = tuple(sorted(set(found.prefill_cpus) | set(found.decode_cpus)))
            if threads is not None and threads != len(cpus):
                raise ValueError(f"--threads {threads} contradicts the plan {found.source}, which runs on "
                                 f"{len(cpus)} CPUs {list(cpus)}; omit --threads or pass another --plan")
            return cpus, Path(found.source)
    return usable[:threads or len(usable)], None


# Runs a command on a CPU set: the affinity survives exec, so the server's threads stay on it.
_PIN = ("import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
        "os.execvp(sys.argv[2], sys.argv[2:])")


def pinned(cmd: list[str], cpus: tuple[int, ...]) -> list[str]:
    """``cmd`` restricted to ``cpus`` (unchanged when they are all this process may use)."""
    from ...host import PROCESS_CPUS

    if set(cpus) == set(PROCESS_CPUS):
        return cmd
    return [sys.executable, "-c", _PIN, ",".join(map(str, cpus)), *cmd]


# Raises the locked-memory limit to its hard limit, then runs the command (an unprivileged
# process's default soft limit, often 8 MiB, would make --mlock fail with only a warning).
_MEMLOCK = ("import os, resource, sys; _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK); "
            "resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard)); os.execvp(sys.argv[1], sys.argv[1:])")


def with_memlock_limit(cmd: list[str]) -> list[str]:
    """``cmd`` run with the soft ``RLIMIT_MEMLOCK`` raised to the hard one."""
    return [sys.executable, "-c", _MEMLOCK, *cmd]


def memlock_limit() -> dict[str, int | None]:
    """This process's locked-memory limits in bytes (None: unlimited)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {k: None if v == resource.RLIM_INFINITY else v for k, v in (("soft", soft), ("hard", hard))}


def turn_order(systems: tuple[str, ...], rounds: int) -> list[tuple[int, str]]:
    """``(round, system)`` in run order: the systems in turn, reversed every other round."""
    return [(r, name) for r in range(rounds) for name in (systems if r % 2 == 0 else systems[::-1])]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "model"


def build_requests(cfg: ServeBenchConfig, model: LlamaConfig, log: Log) -> tuple[list[Request], dict]:
    """The requests every system gets, and a description of them for the report."""
    if cfg.lengths is not None:
        if cfg.mode == "multiturn":
            raise ValueError("--mode multiturn replays ShareGPT conversations; drop --lengths")
        reqs = fixed_requests(list(cfg.lengths), cfg.num_prompts, model.vocab_size, cfg.seed)
        source = {"source": "fixed", "lengths": [list(p) for p in cfg.lengths]}
    else:
        from ...model.tokenizer import load_model_tokenizer

        tok = load_model_tokenizer(cfg.model)
        if tok is None:
            raise ValueError(f"{cfg.model} has no tokenizer.json to tokenize ShareGPT with; give "
                             "--lengths PROMPT:OUTPUT,... instead")
        what = "multi-turn conversations" if cfg.mode == "multiturn" else "requests"
        log(f"sampling {cfg.num_prompts} ShareGPT {what} (tokenizer: {tok.source}, context {cfg.context}, "
            f"output <= {cfg.max_output or 'unclipped'})")
        if cfg.mode == "multiturn":
            reqs = sharegpt_conversations(tok, cfg.num_prompts, context=cfg.context,
                                          max_output=cfg.max_output, max_turns=cfg.max_turns, seed=cfg.seed)
        else:
            reqs = sharegpt_requests(tok, cfg.num_prompts, context=cfg.context, max_output=cfg.max_output,
                                     seed=cfg.seed, log=log)
        if not reqs:
            raise ValueError(f"no ShareGPT request fits a context of {cfg.context} tokens")
        if len(reqs) < cfg.num_prompts:
            log(f"warning: only {len(reqs)} ShareGPT requests fit the context of {cfg.context}")
        source = {"source": "sharegpt", "tokenizer": tok.source, "max_output": cfg.max_output}
        if cfg.mode == "multiturn":
            source |= {"multiturn": {"conversations": len({r.conversation for r in reqs}),
                                     "max_turns": cfg.max_turns, "think_s": cfg.think_s,
                                     "history": "the dataset's answers"}}
    too_long = [r for r in reqs if r.prompt_len + r.max_tokens > cfg.context]
    if too_long:
        raise ValueError(f"a request of {too_long[0].prompt_len}+{too_long[0].max_tokens} tokens exceeds "
                         f"--context {cfg.context}")
    source |= {"requests": len(reqs),
               "mean_prompt_tokens": sum(r.prompt_len for r in reqs) / len(reqs),
               "mean_output_tokens": sum(r.max_tokens for r in reqs) / len(reqs)}
    return reqs, source


def server_command(system: str, cfg: ServeBenchConfig, model: LlamaConfig, port: int,
                   log: Log) -> tuple[list[str], dict[str, str]]:
    """The command line (pinned to ``cfg.cpus``) and environment serving ``cfg.model`` as
    ``system`` on ``port``: the same weights (``--seed``), threads and parallel sequences."""
    env = {**os.environ, "TVM_NUM_THREADS": str(cfg.threads), "OMP_NUM_THREADS": str(cfg.threads)}
    if system in SANDWICH_SYSTEMS:
        cmd = [sys.executable, "-m", "sandwich_tvm.serve", "--model", cfg.model, "--host", "127.0.0.1",
               "--port", str(port), "--max-batch", str(cfg.max_batch),
               "--context", str(cfg.context), "--kv-cache-tokens", str(cfg.kv_tokens()),
               "--kv-dtype", cfg.kv_dtype, "--prefill-budget", str(cfg.prefill_budget),
               "--priority", cfg.priority, "--seed", str(cfg.seed), "--dtype", cfg.dtype,
               *SANDWICH_SYSTEMS[system]]
        if system == "sandwich-draft":
            if cfg.draft_model is None:
                raise SystemUnavailable("sandwich-draft drafts with a model: give --draft-model MODEL")
            cmd += ["--draft-model", cfg.draft_model, "--draft-dtype", cfg.draft_dtype]
        if cfg.plan is not None:
            cmd += ["--plan", str(cfg.plan)]
        return pinned(cmd, cfg.cpus), env
    if system in LLAMA_SERVER_SYSTEMS:
        from ..baselines import llamaserver

        why = llamaserver.unavailable()
        binary = llamaserver.find_llama_server()
        if why is not None or binary is None:
            raise SystemUnavailable(why or "llama-server was not found")
        try:
            gguf = llamaserver.gguf_for(cfg.model, model, cfg.seed, log=log, dtype=cfg.dtype)
        except ImportError as err:
            raise SystemUnavailable(f"writing the GGUF needs the {err.name} package "
                                    "(pip install -e '.[llamacpp]')") from None
        locked = LLAMA_SERVER_SYSTEMS[system]
        cmd = llamaserver.llama_server_command(binary, gguf, threads=cfg.threads, slots=cfg.max_batch,
                                               context_per_slot=cfg.context, port=port, locked=locked)
        return pinned(with_memlock_limit(cmd) if locked else cmd, cfg.cpus), env
    raise SystemUnavailable(f"unknown system {system!r}; choose from "
                            f"{', '.join(dict.fromkeys([*SYSTEMS, *SANDWICH_SYSTEMS]))}")


@contextlib.contextmanager
def launch_server(system: str, cmd: list[str], port: int, env: dict[str, str], log_path: Path,
                  ready_timeout_s: float = 600.0) -> Iterator[str]:
    """Start a server with ``ServerProcess``, wait for its /health, stop it on exit."""
    with ServerProcess(system, cmd, port, log_path=log_path, ready_timeout_s=ready_timeout_s,
                       env=env) as server:
        yield server.base_url


class _Progress:
    """Progress lines at most every few seconds, and at the end."""

    def __init__(self, log: Log, label: str, every_s: float = 5.0):
        self.log, self.label, self.every_s, self.last = log, label, every_s, time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if done >= total or time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            self.log(f"  {self.label}: {done}/{total} requests done")


def _run_line(system: str, run: RunResult, slo: Slo) -> str:
    ok = [r for r in run.records if r.sent and r.ok]
    ttft = percentiles((r.ttft_s * 1e3 for r in ok), (90,))["p90"]
    tpot = percentiles((r.tpot_s * 1e3 for r in ok if r.tpot_s is not None), (90,))["p90"]
    att = attainment(run.records, slo)
    sent = sum(r.sent for r in run.records)
    return (f"{system} @ {'single' if run.rate is None else f'{run.rate:g} req/s'}: {len(ok)}/{sent} ok, "
            f"P90 TTFT {'-' if ttft is None else f'{ttft:.0f}'} ms, P90 TPOT "
            f"{'-' if tpot is None else f'{tpot:.1f}'} ms, SLO attainment "
            f"{'-' if att is None else f'{att:.0%}'}")


class _Benchmark:
    """One ``bench serve`` run: the shared requests, the systems so far, the report on disk."""

    def __init__(self, cfg: ServeBenchConfig, model: LlamaConfig, log: Log, launcher: Launcher):
        self.cfg, self.model, self.log, self.launcher = cfg, model, log, launcher
        self.slo, self.slo_source = cfg.slo(model)
        self.rates: list[float | None] = [None] if cfg.mode == "single" else list(cfg.rates)
        # Each (round, rate) gets its own requests, so no system serves a prompt it has cached
        # earlier (llama-server caches prompts per slot by default); every system gets the same.
        sets = len(self.rates) * cfg.rounds
        reqs, workload = build_requests(replace(cfg, num_prompts=cfg.num_prompts * sets), model, log)
        if cfg.mode == "multiturn":  # whole conversations per set
            per = max(r.conversation for r in reqs) // sets + 1
            self.request_sets = [[r for r in reqs if r.conversation // per == i] for i in range(sets)]
        else:
            per = len(reqs) // sets
            self.request_sets = [reqs[i * per:(i + 1) * per] for i in range(sets)]
        self.requests = self.request_sets[0]
        self.warm_prompt = list(fixed_requests([(8, 4)], 1, model.vocab_size, cfg.seed + 1)[0].prompt_ids)
        self.json_path = cfg.out / f"{cfg.stem(model)}.json"
        self.png_path = cfg.out / f"{cfg.stem(model)}.png"
        self.turns = turn_order(cfg.systems, cfg.rounds)
        self.meta = {
            "model": cfg.model, "model_name": model.name, "num_params": model.num_params(), "mode": cfg.mode,
            "rates": self.rates, "duration_s": cfg.duration_s, "threads": cfg.threads, "cpus": list(cfg.cpus),
            "max_batch": cfg.max_batch, "context": cfg.context, "kv_dtype": cfg.kv_dtype, "dtype": cfg.dtype,
            "scheduler": {"prefill_budget": cfg.prefill_budget, "priority": cfg.priority},
            "draft_model": cfg.draft_model, "draft_dtype": cfg.draft_dtype if cfg.draft_model else None,
            "kv_cache_tokens": {k: cfg.kv_tokens() for k in cfg.systems},
            "plan": None if cfg.plan is None else str(cfg.plan), "seed": cfg.seed, "timeout_s": cfg.timeout_s,
            "rounds": cfg.rounds,
            "interleaving": (f"{cfg.rounds} rounds; in each, every system in turn runs every rate on a "
                             "freshly started server; the turn order is reversed every other round"),
            "turns": [{"round": r, "system": name} for r, name in self.turns],
            "order": [],  # (round, system, rate) of every run, as it started
            "workload": workload, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if any(LLAMA_SERVER_SYSTEMS.get(name) for name in cfg.systems):
            self.meta["memlock_limit_bytes"] = memlock_limit()  # --mlock raises soft to hard
        self.systems = {name: SystemRuns(name) for name in cfg.systems}
        self._spec_seen: dict[str, dict[str, float]] = {}

    def save(self, plot: bool = False) -> dict:
        doc = build_report(self.meta, list(self.systems.values()), self.slo, self.slo_source,
                           self.cfg.slo_scales)
        save_report(doc, self.json_path)
        if plot:
            plot_report(doc, self.png_path)
        return doc

    def run(self) -> dict:
        cfg, w = self.cfg, self.meta["workload"]
        self.log(f"SLO: TTFT {self.slo.ttft_ms:g} ms, TPOT {self.slo.tpot_ms:g} ms ({self.slo_source}); "
                 f"{len(self.requests)} requests per rate and round, mean {w['mean_prompt_tokens']:.0f} "
                 f"prompt / {w['mean_output_tokens']:.0f} output tokens; {cfg.threads} threads on CPUs "
                 f"{list(cfg.cpus)}; {cfg.rounds} rounds; results in {self.json_path}")
        for k, name in self.turns:
            s = self.systems[name]
            if s.status in ("skipped", "failed"):
                continue
            try:
                self.run_turn(s, k)
            finally:
                if s.status == "running":
                    s.status, s.reason = "failed", "interrupted"
                self.save(plot=True)
        return self.save(plot=True)

    def run_turn(self, s: SystemRuns, k: int) -> None:
        """Round ``k`` of one system: start its server, warm it up, run every rate, stop it;
        failures end up in ``s`` (and end its later rounds)."""
        cfg, port = self.cfg, free_port()
        try:
            cmd, env = server_command(s.name, cfg, self.model, port, self.log)
        except SystemUnavailable as err:
            s.status, s.reason = "skipped", str(err)
            self.log(f"{s.name}: skipped: {err}")
            return
        except (OSError, ValueError, RuntimeError) as err:
            s.status, s.reason = "failed", f"{type(err).__name__}: {err}"
            self.log(f"{s.name}: failed to prepare: {s.reason}")
            return
        s.command, s.status = s.command or cmd, "running"
        tag = "" if cfg.rounds == 1 else f"_round{k + 1}"
        log_path = cfg.out / "logs" / f"{cfg.stem(self.model)}_{s.name}{tag}.log"
        self.log(f"{s.name}: round {k + 1}/{cfg.rounds}: starting the server (log {log_path})")
        try:
            with self.launcher(s.name, cmd, port, env, log_path) as base_url:
                warm = asyncio.run(warm_up(base_url, cfg.model, self.warm_prompt, timeout_s=cfg.timeout_s))
                if not warm.ok:
                    raise RuntimeError(f"the warm-up request failed: {warm.error}")
                if s.name in SANDWICH_SYSTEMS:  # the runs' draft counters start after the warm-up
                    self._spec_seen[s.name] = scrape_counters(base_url, SPEC_COUNTERS)
                for i, rate in enumerate(self.rates):
                    self.run_rate(s, base_url, k, i, rate)
            s.status = "ok"
        except (ServerStartError, OSError, RuntimeError) as err:
            s.status, s.reason = "failed", f"round {k + 1}: {err}" if cfg.rounds > 1 else str(err)
            self.log(f"{s.name}: failed: {err} (server log: {log_path})")

    def _spec_delta(self, s: SystemRuns, base_url: str) -> dict | None:
        """The server's speculative counters since its previous run (None where it drafted nothing)."""
        now = scrape_counters(base_url, SPEC_COUNTERS)
        if not now:  # not read this time: the next run's delta covers both
            return None
        before, self._spec_seen[s.name] = self._spec_seen.get(s.name, {}), now
        delta = {k: v - before.get(k, 0.0) for k, v in now.items()}
        return delta if delta.get("drafted") else None

    def run_rate(self, s: SystemRuns, base_url: str, k: int, i: int, rate: float | None) -> None:
        cfg = self.cfg
        label = f"{s.name} @ {'single' if rate is None else f'{rate:g} req/s'}, round {k + 1}"
        reqs = self.request_sets[k * len(self.rates) + i]
        self.meta["order"].append({"round": k, "system": s.name, "rate": rate})
        run = asyncio.run(run_requests(base_url, cfg.model, reqs, mode=cfg.mode, rate=rate,
                                       seed=cfg.seed + k, duration_s=cfg.duration_s, timeout_s=cfg.timeout_s,
                                       think_s=cfg.think_s,
                                       progress=_Progress(self.log, label)))
        if s.name in SANDWICH_SYSTEMS:
            run = replace(run, speculative=self._spec_delta(s, base_url))
        s.runs.append(replace(run, round=k))
        self.save()
        self.log(_run_line(s.name, run, self.slo))
        if all(not r.ok for r in run.records if r.sent):  # the server is gone: stop its sweep
            error = next((r.error for r in run.records if r.error), "?")
            raise RuntimeError(f"every request at {label} failed ({error})")


def run_benchmark(cfg: ServeBenchConfig, model: LlamaConfig, log: Log,
                  launcher: Launcher | None = None) -> dict:
    """Run every system over every rate, ``cfg.rounds`` times, the systems taking turns; returns
    the report (also saved under ``cfg.out`` after every rate, with a PNG after every turn).
    ``launcher`` replaces ``ServerProcess`` in tests."""
    if launcher is None:
        def launcher(system, cmd, port, env, log_path):
            return launch_server(system, cmd, port, env, log_path, cfg.ready_timeout_s)

    return _Benchmark(cfg, model, log, launcher).run()


def scrape_counters(base_url: str, names: dict[str, str]) -> dict[str, float]:
    """Prometheus counters of a server's ``/metrics`` (``names``: key -> metric name), summed
    over their labels; a metric it does not report is absent."""
    import httpx

    try:
        return read_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text, names)
    except (httpx.HTTPError, ValueError):  # unreachable, or not an exposition
        return {}
