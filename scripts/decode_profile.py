"""Time one decode step (or one prompt's prefill) of a compiled model, op by op (the Relax
VM's instrument hook).

    python scripts/decode_profile.py --model llama-160m --plan examples/plans/two-cpus-tp1.json
    python scripts/decode_profile.py --model llama-160m --plan examples/plans/two-cpus-tp2.json --rank 0
    python scripts/decode_profile.py --model llama-3.2-1b --plan examples/plans/two-cpus-tp1.json \
        --phase prefill --prompt 512 --steps 3

With a tensor-parallel plan, ``--rank`` runs that rank's shard alone in this process, on the
rank's CPUs, with local stand-ins for the collectives (the all-reduce returns this rank's
partial sum): what the rank's own kernels cost, without waiting for its peers. The per-op
times include the hook's overhead (a Python call before and after each op); the TPOT line
does not.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import numpy as np  # noqa: E402
import tvm_ffi  # noqa: E402

from sandwich_tvm.compiler.artifact import compile_model  # noqa: E402
from sandwich_tvm.model.config import load_config  # noqa: E402
from sandwich_tvm.model.parallel import ALLREDUCE, ALLREDUCE_ADD, GATHER  # noqa: E402
from sandwich_tvm.model.weights import load_params  # noqa: E402
from sandwich_tvm.runtime.engine import Engine  # noqa: E402
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan  # noqa: E402


def _local_collectives() -> None:
    """One rank alone: the all-reduce is this rank's part, the gather fills this rank's columns."""

    def allreduce(x, out):
        np.from_dlpack(out)[...] = np.from_dlpack(x)

    def allreduce_add(x, residual, out):
        np.from_dlpack(out)[...] = np.from_dlpack(x) + np.from_dlpack(residual)

    def gather(x, out):
        part, whole = np.from_dlpack(x), np.from_dlpack(out)
        width = min(part.shape[-1], whole.shape[-1])
        whole[...] = 0
        whole[..., :width] = part[..., :width]

    for name, fn in ((ALLREDUCE, allreduce), (ALLREDUCE_ADD, allreduce_add), (GATHER, gather)):
        tvm_ffi.register_global_func(name, fn, override=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-160m", help="preset or checkpoint directory")
    ap.add_argument("--plan", type=Path, required=True, help="plans.json (its first plan)")
    ap.add_argument("--rank", type=int, default=0, help="the rank of a tensor-parallel plan to run")
    ap.add_argument("--dtype", default="bfloat16", help="weight dtype (default bfloat16)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (prefill: prompts)")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                    help="profile decode steps or whole prompts' prefill (default decode)")
    ap.add_argument("--top", type=int, default=15, help="ops to list")
    args = ap.parse_args()

    cfg = load_config(args.model)
    plan = ExecPlan.from_file(args.plan)
    compiled = compile_model(RunSpec(cfg.name, cfg, plan, weight_dtype=args.dtype), log=print)
    isa, dtype = compiled.weight_layout
    if compiled.tp > 1:
        _local_collectives()
    params = load_params(args.model, compiled.config, compiled.params, isa, dtype=dtype,
                         layouts=compiled.layouts, shards=compiled.shards, rank=args.rank, tp=compiled.tp)
    engine = Engine(compiled, params, plan.rank(args.rank) if compiled.tp > 1 else plan)
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, cfg.vocab_size, args.prompt)]
    gen = engine.generate(prompt, args.steps)
    print(f"{cfg.name}, {plan.describe()}" + (f", rank {args.rank} alone" if compiled.tp > 1 else "")
          + f": TPOT {gen.tpot_ms:.2f} ms over {args.steps} steps (no hook)")

    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    start = [0.0]

    def hook(_func, name, before, _ret, *_args):
        if before:
            start[0] = time.perf_counter()
        else:
            spent[name] += time.perf_counter() - start[0]
            calls[name] += 1
        return 0

    if args.phase == "prefill":  # a fresh sequence per prompt, the hook around its prefill
        engine.vm.set_instrument(hook)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.start()
            engine.use("prefill")
            engine.prefill(prompt)
            engine.stop()
    else:
        engine.start()
        engine.use("prefill")
        engine.prefill(prompt)
        engine.use("decode")
        engine.vm.set_instrument(hook)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.decode(5)
        engine.stop()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    ops_ms = sum(spent.values()) / args.steps * 1e3
    print(f"{args.phase} step with the hook: {step_ms:.2f} ms; ops: {ops_ms:.2f} ms")
    for name, secs in sorted(spent.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {secs / args.steps * 1e3:7.3f} ms  x{calls[name] // args.steps:<4d} {name}")


if __name__ == "__main__":
    main()
