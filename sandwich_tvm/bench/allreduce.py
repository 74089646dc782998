"""`python -m sandwich_tvm.bench allreduce`: the shared-memory all-reduce against
torch.distributed's gloo backend, 2..P processes, in one run.

Each system's ranks are placed as its users run them (``PLACEMENTS``; the JSON's ``placement``
gives every rank's CPUs and the CPUs its threads were allowed on): the shared-memory ranks one
per CPU, gloo's ranks not pinned (as ``torchrun`` starts them, one torch thread each) on the
same P CPUs, so gloo's I/O threads are not stacked on their rank's only CPU. ``gloo-pinned``
(not run by default) pins gloo's ranks, I/O threads and all, one per CPU.

Each (system, processes, size) is the median over rounds of back-to-back all-reduces timed on
rank 0. Two bandwidths, both next to the machine's streaming-read bandwidth on all CPUs,
measured in the same run:

- the "bus bandwidth" (2 (P - 1) / P x bytes / time, NCCL's convention: what each rank's link
  carries), and
- the memory throughput: the traffic any all-reduce from private inputs to private outputs
  must cause, every rank reading its input and writing its output (2 P x bytes), per second.
  Once messages outgrow the caches the op is bound by memory, and this says how close to the
  machine's bandwidth it runs; the bus bandwidth of such an op cannot exceed (P - 1) / P^2 of
  the memory bandwidth (a quarter for two ranks), whatever the algorithm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

# floats: one decode token of llama-160m / Llama-3.2-1B / Llama-3-8B, up to a 2048-token
# prefill of Llama-3.2-1B's hidden state (16 MB)
DEFAULT_SIZES = "768,2048,4096,16384,65536,262144,1048576,4194304"


def add_allreduce_parser(sub) -> None:
    a = sub.add_parser("allreduce", help="shared-memory all-reduce vs torch.distributed gloo")
    a.add_argument("--procs", type=int, default=None,
                   help="largest process count (default: CPUs, at least 2)")
    a.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"float32 elements per message (default {DEFAULT_SIZES})")
    a.add_argument("--rounds", type=int, default=5, help="timed rounds per size; medians (default 5)")
    a.add_argument("--systems", default="shm,gloo",
                   help="shm, gloo, gloo-pinned (default shm,gloo: gloo's ranks not pinned, as torchrun "
                        "runs them; gloo-pinned: one CPU per rank, its I/O threads on it too)")
    a.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    a.add_argument("--plot", type=Path, default=Path("out/bench_allreduce.png"), help="PNG plot path")


def _iters(nbytes: int) -> int:
    return int(min(2000, max(5, 2e8 / max(nbytes, 1) / 50)))


def _time(fn, nbytes: int, rounds: int) -> float:
    """Median seconds per call over ``rounds`` rounds of back-to-back calls (after a warm-up)."""
    n = _iters(nbytes)
    for _ in range(min(n, 20)):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return float(np.median(out))


SYSTEMS = ("shm", "gloo", "gloo-pinned")
PLACEMENTS = {
    "shm": "rank r pinned to the r-th CPU, one CPU each",
    "gloo": "not pinned, as torchrun starts them: every rank's threads (main and gloo's I/O) may run on "
            "any of the first P CPUs; one torch thread per rank (torchrun's OMP_NUM_THREADS=1)",
    "gloo-pinned": "rank r pinned to the r-th CPU, one CPU each, gloo's I/O threads on it too; one torch "
                   "thread per rank",
}


def rank_cpus(system: str, rank: int, world: int, cpus: list[int]) -> list[int]:
    """The CPUs rank ``rank`` of ``world`` may use under ``system``'s placement (``PLACEMENTS``)."""
    if system == "gloo":
        return list(cpus[:world]) if world <= len(cpus) else list(cpus)
    return [cpus[rank % len(cpus)]]


def _place(system: str, rank: int, world: int, cpus: list[int], every_thread: bool = True) -> None:
    """Put this thread, and with ``every_thread`` every other thread of this rank's process, on
    ``rank_cpus`` (the benchmark's CPUs are passed down: a child's own affinity is whatever its
    parent's was when it started, possibly one CPU, which would stack ranks). Threads started
    later, like gloo's I/O threads, inherit it."""
    mine = set(rank_cpus(system, rank, world, cpus))
    if every_thread:  # e.g. OpenBLAS's workers, started as numpy loaded
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), mine)
    os.sched_setaffinity(0, mine)


def thread_cpus() -> list[list[int]]:
    """The distinct CPU sets this process's threads may run on (``/proc/self/task``)."""
    sets = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            sets.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
    return [list(x) for x in sorted(sets)]


def _shm_rank(name: str, rank: int, world: int, slot: int, sizes: list[int], rounds: int, cpus: list[int],
              q) -> None:
    from ..collective.shm import ShmGroup

    _place("shm", rank, world, cpus)
    with ShmGroup.attach(name, rank, world, slot) as group:
        for n in sizes:
            x, out = np.ones(n, np.float32), np.empty(n, np.float32)
            _time(lambda x=x, out=out: group.allreduce(x, out), 4 * n, rounds)
    q.put(rank)


def run_shm(world: int, sizes: list[int], rounds: int, cpus: list[int] | None = None) -> dict[int, float]:
    """Rank 0's median seconds per size, rank r pinned to the r-th of ``cpus`` (default: the
    CPUs this process may use)."""
    from ..collective.shm import ShmGroup

    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    out = {}
    with ShmGroup.create(world, 4 * max(sizes)) as group:
        procs = [ctx.Process(target=_shm_rank,
                             args=(group.name, r, world, group.slot, sizes, rounds, cpus, q))
                 for r in range(1, world)]
        for p in procs:
            p.start()
        before = os.sched_getaffinity(0)
        _place("shm", 0, world, cpus, every_thread=False)  # the caller's own threads stay put
        try:
            for n in sizes:
                x, y = np.ones(n, np.float32), np.empty(n, np.float32)
                out[n] = _time(lambda x=x, y=y: group.allreduce(x, y), 4 * n, rounds)
        finally:
            os.sched_setaffinity(0, before)
        for _ in procs:
            q.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    return out


def _gloo_rank(path: str, rank: int, world: int, sizes: list[int], rounds: int, cpus, q,
               system: str = "gloo") -> None:
    _place(system, rank, world, cpus)  # first: threads torch starts as it loads inherit it
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    times = {}
    for n in sizes:
        t = torch.ones(n, dtype=torch.float32)
        times[n] = _time(lambda t=t: dist.all_reduce(t), 4 * n, rounds)
    threads = thread_cpus()  # gloo's I/O threads are up now
    dist.destroy_process_group()
    q.put((rank, times, threads))


def run_gloo(world: int, sizes: list[int], rounds: int, cpus: list[int] | None = None,
             system: str = "gloo", threads: dict[int, list[list[int]]] | None = None) -> dict[int, float]:
    """Rank 0's median seconds per size, the ranks placed on ``cpus`` (default: the CPUs this
    process may use) as ``system`` (gloo or gloo-pinned) says; ``threads`` gets each rank's
    threads' CPU sets."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "rendezvous")
        procs = [ctx.Process(target=_gloo_rank, args=(path, r, world, sizes, rounds, cpus, q, system))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = {rank: (times, seen) for rank, times, seen in (q.get(timeout=600) for _ in procs)}
        for p in procs:
            p.join(timeout=60)
    if threads is not None:
        threads.update({rank: seen for rank, (_, seen) in got.items()})
    return got[0][0]


def bench_allreduce(procs: int, sizes: list[int], rounds: int, systems: list[str], log) -> dict:
    from ..topology.microbench import BandwidthProbe

    cpus = sorted(os.sched_getaffinity(0))
    read_gbs = BandwidthProbe(cpus).sample()
    log(f"streaming read on CPUs {cpus}: {read_gbs:.1f} GB/s")
    rows = []
    placement: dict[str, dict] = {s: {"how": PLACEMENTS[s], "ranks": {}} for s in systems}
    for world in range(2, procs + 1):
        results = {}
        for system in systems:
            log(f"{system}: {world} processes over {len(sizes)} sizes ...")
            seen: dict[int, list[list[int]]] = {}
            if system == "shm":
                results[system] = run_shm(world, sizes, rounds, cpus)
            else:
                results[system] = run_gloo(world, sizes, rounds, cpus, system=system, threads=seen)
            placement[system]["ranks"][str(world)] = [
                {"rank": r, "cpus": rank_cpus(system, r, world, cpus), "thread_cpus": seen.get(r)}
                for r in range(world)]
        for n in sizes:
            row = {"procs": world, "floats": n, "bytes": 4 * n}
            for system, times in results.items():
                key = system.replace("-", "_")
                row[f"{key}_us"] = times[n] * 1e6
                row[f"{key}_bus_gbs"] = 2 * (world - 1) / world * 4 * n / times[n] / 1e9
                row[f"{key}_mem_gbs"] = 2 * world * 4 * n / times[n] / 1e9
                row[f"{key}_mem_of_read"] = row[f"{key}_mem_gbs"] / read_gbs
            if "shm_us" in row and "gloo_us" in row:
                row["latency_ratio"] = row["shm_us"] / row["gloo_us"]
            rows.append(row)
    return {"cpus": cpus, "read_gbs": read_gbs, "rounds": rounds, "placement": placement, "rows": rows}


def plot_allreduce(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for world in sorted({r["procs"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["procs"] == world]
        for system, style in (("shm", "-o"), ("gloo", "--s"), ("gloo_pinned", ":^")):
            if f"{system}_us" in rows[0]:
                ax.plot([r["bytes"] for r in rows], [r[f"{system}_us"] for r in rows], style,
                        label=f"{system}, {world} processes")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message bytes (float32)")
    ax.set_ylabel("latency µs (median)")
    ax.set_title("all-reduce: shared memory vs gloo")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main_allreduce(args: argparse.Namespace, console: Console) -> int:
    from ..cli.args import positive_ints
    from ..cli.common import print_error

    try:
        sizes = positive_ints(args.sizes, "--sizes")
    except ValueError as err:
        print_error(console, f"bad --sizes {args.sizes!r}: {err}")
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        print_error(console, f"--systems takes {', '.join(SYSTEMS)}, not {args.systems!r}")
        return 2
    procs = args.procs or max(2, len(os.sched_getaffinity(0)))
    if procs < 2:
        print_error(console, "--procs needs at least 2 processes")
        return 2
    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    result = bench_allreduce(procs, sizes, max(1, args.rounds), systems, log)
    plot_allreduce(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    table = Table(title=f"all-reduce, float32, CPUs {result['cpus']} (streaming read "
                        f"{result['read_gbs']:.1f} GB/s)")
    for col in ("procs", "bytes", "shm µs", "gloo µs", "gloo pinned µs", "shm / gloo", "shm bus GB/s",
                "gloo bus GB/s", "shm memory GB/s", "of read BW"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        def f(key: str, fmt: str, r=r) -> str:
            return fmt.format(r[key]) if key in r else "-"
        table.add_row(str(r["procs"]), str(r["bytes"]), f("shm_us", "{:.1f}"), f("gloo_us", "{:.1f}"),
                      f("gloo_pinned_us", "{:.1f}"), f("latency_ratio", "{:.2f}"), f("shm_bus_gbs", "{:.2f}"),
                      f("gloo_bus_gbs", "{:.2f}"),
                      f("shm_mem_gbs", "{:.1f}"), f("shm_mem_of_read", "{:.2f}"))
    console.print(table)
    for system, where in result["placement"].items():
        console.print(f"{system}: {where['how']}", markup=False)
    console.print(f"plot: {args.plot}")
    return 0
