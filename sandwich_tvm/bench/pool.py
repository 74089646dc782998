"""`python -m sandwich_tvm.bench pool`: what TVM's thread pool costs a tiny decode operator.

Every parallel loop of a kernel wakes the pool's workers and meets them at a barrier when the
loop ends. A decode step runs a few hundred such kernels (norms, casts, the cache's RoPE and
append, attention, the GEMVs), most of them far smaller than the wake-up would be on a big
socket (the paper's "bounded fan-in synchronization"). Measured here: the time of one call of
an elementwise kernel over ``--elements`` floats (a decode step's hidden state) in 8 parallel
chunks, on 1..N threads of the pool, against the same loop serial on the calling thread, each
the median of ``--repeat`` runs of ``--number`` back-to-back calls; the barrier is the
N-thread call less the serial one.

With ``--model``, the model's decode function is read from its compiled library (kernel calls
per step, and the KV cache's attention calls, each of which launches its RoPE, its append and
the attention kernel's two parallel loops: 4 launches), a one-token decode step is timed, and
the pool's share of it is estimated as barrier x launches / TPOT.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
from rich.console import Console

from ..cli.args import positive_int

CHUNKS = 8  # parallel chunks of the elementwise probe
CACHE_LAUNCHES = 4  # parallel launches of one KV-cache attention call: RoPE, append, attention's two loops


def add_pool_parser(sub) -> None:
    a = sub.add_parser("pool", help="per-call cost of TVM's thread pool on tiny decode operators")
    a.add_argument("--elements", type=positive_int, default=2048,
                   help="floats the probe kernel writes (default 2048: Llama-3.2-1B's hidden state)")
    a.add_argument("--number", type=positive_int, default=20000, help="calls per timed run (default 20000)")
    a.add_argument("--repeat", type=positive_int, default=7, help="timed runs; medians (default 7)")
    a.add_argument("--model", default=None, help="also count a model's decode launches and time its step")
    a.add_argument("--dtype", default="auto", help="the model's weight type (as for generate)")
    a.add_argument("--steps", type=positive_int, default=64, help="decode steps timed (default 64)")
    a.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results here")


def _probe(elements: int, parallel: bool):
    """``b = 2 a`` over ``elements`` floats in ``CHUNKS`` chunks, parallel or serial."""
    from ..tvm_compat import T, host_target, tvm

    chunk = -(-elements // CHUNKS)
    loop = T.parallel if parallel else T.serial

    @T.prim_func
    def probe(a: T.Buffer((CHUNKS * chunk,), "float32"), b: T.Buffer((CHUNKS * chunk,), "float32")):
        for c in loop(CHUNKS):
            for i in T.vectorized(chunk):
                b[c * chunk + i] = a[c * chunk + i] * T.float32(2)

    exe = tvm.compile(tvm.IRModule({"probe": probe}), target=host_target())
    return exe, CHUNKS * chunk


def measure_pool(cpus: list[int], elements: int, number: int, repeat: int) -> dict:
    """Microseconds per call: the serial loop, and the parallel one on 1..len(cpus) threads."""
    from ..tvm_compat import pin_thread_pool, tvm

    out: dict = {"cpus": cpus, "elements": elements, "parallel_us": {}}
    for parallel in (False, True):
        exe, size = _probe(elements, parallel)
        a = tvm.runtime.tensor(np.ones(size, np.float32))
        b = tvm.runtime.empty((size,), "float32", tvm.cpu())
        timer = exe.mod.time_evaluator("probe", tvm.cpu(), number=number, repeat=repeat)
        for t in range(1, len(cpus) + 1) if parallel else [1]:
            pin_thread_pool(cpus[:t])
            us = float(np.median(timer(a, b).results)) * 1e6
            if parallel:
                out["parallel_us"][str(t)] = us
            else:
                out["serial_us"] = us
    pin_thread_pool(cpus)
    out["barrier_us"] = out["parallel_us"][str(len(cpus))] - out["serial_us"]
    return out


def decode_calls(library: Path) -> dict:
    """The ``decode`` function's calls in a compiled model: TIR kernels and the KV cache's
    attention (``vm.builtin`` calls that are not attention are bookkeeping: no kernel)."""
    from ..tvm_compat import tvm

    text = tvm.relax.VMExecutable(tvm.runtime.load_module(str(library))).as_text()
    found = re.search(r"^@decode:\n(.*?)(?=^@|\Z)", text, re.S | re.M)
    if found is None:
        raise ValueError(f"{library} has no decode function")
    calls = re.findall(r"call\s+(\S+)", found.group(1))
    return {"kernel_calls": sum(not c.startswith("vm.builtin") for c in calls),
            "cache_attention_calls": sum(c.startswith("vm.builtin.attention_kv_cache") for c in calls)}


def time_model(model: str, dtype: str, steps: int, log) -> dict:
    """The model's decode launches and its median one-token decode step on every CPU."""
    from ..model.config import load_config
    from ..runtime.loader import open_engine
    from ..spec import resolve_run_spec

    prompt = min(128, load_config(model).max_position_embeddings // 2)
    spec = resolve_run_spec(model, dtype=dtype, needed_tokens=prompt + steps, max_batch=1, log=log)
    steps = min(steps, spec.context - prompt)
    engine, compiled = open_engine(spec, log=log)
    try:
        gen = engine.generate(list(range(1, prompt + 1)), steps)
    finally:
        engine.close()
    calls = decode_calls(compiled.path / "model.so")
    return {"model": spec.config.name, "dtype": spec.weight_dtype, "tpot_ms": gen.to_json()["tpot_ms"],
            **calls, "launches": calls["kernel_calls"] + CACHE_LAUNCHES * calls["cache_attention_calls"]}


def main_pool(args: argparse.Namespace, console: Console) -> int:
    from ..host import host_signature
    from ..tvm_compat import PROCESS_CPUS

    cpus = sorted(PROCESS_CPUS)
    out = measure_pool(cpus, args.elements, args.number, args.repeat)
    cpu = host_signature()
    out["cpu"] = f"{cpu.model_name} ({cpu.slug})"
    out["command"] = "python -m sandwich_tvm.bench " + " ".join(args.argv)
    console.print(f"serial {out['serial_us']:.2f} us a call; parallel "
                  + ", ".join(f"{t} threads {us:.2f} us" for t, us in out["parallel_us"].items())
                  + f"; barrier {out['barrier_us']:.2f} us")
    if args.model:
        from ..cli.common import print_error
        from ..cli.options import LOAD_ERRORS

        try:
            m = out["model"] = time_model(args.model, args.dtype, args.steps, log=console.print)
        except (*LOAD_ERRORS, ValueError) as exc:
            print_error(console, exc)
            return 2
        m["barrier_ms_per_step"] = m["launches"] * out["barrier_us"] / 1e3
        m["barrier_share"] = m["barrier_ms_per_step"] / m["tpot_ms"]
        console.print(f"{m['model']} ({m['dtype']}): {m['kernel_calls']} kernel calls and "
                      f"{m['cache_attention_calls']} cache attention calls a decode step, ~{m['launches']} "
                      f"parallel launches: {m['barrier_ms_per_step']:.3f} ms of a {m['tpot_ms']:.3f} ms step "
                      f"({m['barrier_share']:.1%})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    else:
        print(json.dumps(out, indent=1))
    return 0
