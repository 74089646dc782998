"""`python -m sandwich_tvm.bench hop --hosts HOST:PORT`: the cost of one hop between this
machine and a worker host, as the pipeline's relayed exchanges pay it.

A hop is one Disco call over the ``SocketSession`` (``runtime.hosts``) that carries a payload
to the worker's rank and the same number of bytes back: what every exchange of a relayed
pipeline step costs (the stages' arrays up, their combination down). For each payload size
the median over rounds of ``--repeat`` back-to-back calls. The per-hop latency is the
smallest payload's median; the bandwidth is the slope of a least-squares line through the
medians against the bytes moved (both ways). The simulator takes both for pipeline stages
across hosts (``topology.simulator.HopCost.from_json``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from ..cli.args import positive_int
from ..host import host_signature

# bytes: nothing, a decode token's hidden state (SmolLM2: 576 fp32; Llama-3.2-1B: 2048), a row
# of SmolLM2's logits (49,152 fp32), a 256-token prefill chunk of SmolLM2's hidden states
DEFAULT_SIZES = "0,2304,8192,196608,589824"


def non_negative_ints(text: str) -> list[int]:
    """``--sizes``: comma-separated byte counts."""
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated byte counts, not {text!r}") from None
    if not sizes or min(sizes) < 0:
        raise argparse.ArgumentTypeError(f"byte counts are 0 or more, not {text!r}")
    return sizes


def add_hop_parser(sub) -> None:
    a = sub.add_parser("hop", help="per-hop latency and bandwidth to a worker host (pipeline relays)")
    a.add_argument("--hosts", required=True, metavar="HOST:PORT",
                   help="the worker (`python -m sandwich_tvm.worker --listen HOST:PORT` there)")
    a.add_argument("--sizes", type=non_negative_ints, default=non_negative_ints(DEFAULT_SIZES),
                   help=f"payload bytes each way (default {DEFAULT_SIZES})")
    a.add_argument("--rounds", type=positive_int, default=5,
                   help="rounds over the sizes; medians (default 5)")
    a.add_argument("--repeat", type=positive_int, default=20, help="calls per size and round (default 20)")
    a.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results here")


def measure(hosts: str, sizes: list[int], rounds: int, repeat: int, log=lambda _m: None) -> dict:
    """Median seconds per hop for each size, sizes interleaved round by round, and the line
    through them."""
    from ..runtime.disco_group import DiscoError, DiscoGroup
    from ..runtime.hosts import parse_hosts
    from ..runtime.tp_worker import ENTRYPOINT, HOP_ECHO, HOP_INIT

    group = DiscoGroup(2, ENTRYPOINT, hosts=parse_hosts(hosts))
    try:
        group.start(HOP_INIT)
        payloads = {n: bytes(n) for n in sizes}
        for n in sizes:  # warm-up
            group.gather(HOP_ECHO, payloads[n], n)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(rounds):
            for n in sizes:
                t0 = time.perf_counter()
                answers = [group.gather(HOP_ECHO, payloads[n], n) for _ in range(repeat)]
                times[n].append((time.perf_counter() - t0) / repeat)
                if any(len(bytes(a[1])) != n for a in answers):
                    raise DiscoError(f"the worker answered {len(bytes(answers[-1][1]))} bytes, not {n}")
            log(f"round {r + 1}/{rounds}: "
                + ", ".join(f"{n} B {np.median(times[n]) * 1e3:.3f} ms" for n in sizes))
    finally:
        group.close()
    medians = {n: float(np.median(t)) for n, t in times.items()}
    xs = 2 * np.array(sizes, float)  # bytes moved: the payload there and back
    ys = np.array([medians[n] for n in sizes])
    slope = np.polyfit(xs, ys, 1)[0] if len(set(sizes)) > 1 else 0.0
    return {"sizes_bytes": sizes, "median_s": [medians[n] for n in sizes],
            "rounds_s": {str(n): times[n] for n in sizes},
            "latency_us": medians[min(sizes)] * 1e6, "gbs": float(1 / slope / 1e9) if slope > 0 else None}


def main_hop(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    sizes = args.sizes
    out = measure(args.hosts, sizes, args.rounds, args.repeat, log=console.print)
    cpu = host_signature()
    out |= {"hosts": args.hosts, "cpu": f"{cpu.model_name} ({cpu.slug}), this end",
            "command": f"python -m sandwich_tvm.bench hop --hosts {args.hosts} "
                       f"--sizes {','.join(map(str, sizes))} "
                       f"--rounds {args.rounds} --repeat {args.repeat}"}
    for n, s in zip(sizes, out["median_s"], strict=True):
        console.print(f"{n:>9} B  {s * 1e3:8.3f} ms per hop")
    gbs = f"{out['gbs']:.3f} GB/s" if out["gbs"] else "n/a"
    console.print(f"latency {out['latency_us']:.0f} us, bandwidth {gbs}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    return 0
