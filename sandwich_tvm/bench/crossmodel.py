"""Run a whole compiled model on a CPU that has no TVM compiler: build here, run there.

``crosscheck`` runs the GEMM micro-kernels of another CPU; this runs the whole model built for
it (our Relax pipeline, every kernel: GEMMs, attention over the paged KV cache, RoPE, norms),
and writes the logits of a prompt and of greedy decode steps, to compare with HF transformers
on the same weights. The build side cross-compiles (``SANDWICH_CPU``, a description from
``python -m sandwich_tvm.host --describe`` on the target; another architecture is linked by
``zig cc``); the run side needs numpy and TVM's runtime only, so it runs on an emulated
aarch64 (``scripts/arm_env.py``)::

    .arm64/python -m sandwich_tvm.host --describe > out/arm-cpu.json
    SANDWICH_CPU=out/arm-cpu.json python -m sandwich_tvm.bench.crossmodel build \\
        --model DIR --out out/arm-model
    .arm64/python -m sandwich_tvm.bench.crossmodel run out/arm-model --prompt 1,2,3 --steps 8 --out DIR

Emulation checks what the code computes, not how fast: never time under it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .crosscheck import restored, storable

FORMAT = 1
PAGE = 16


def build(model: str, out: Path, dtype: str = "float32", kv_dtype: str = "float32",
          context: int = 128, int8_activations: bool = False, log=print) -> dict:
    """Compile ``model`` for the CPU ``SANDWICH_CPU`` describes into ``out`` (``model.so``,
    ``params.npz``, ``manifest.json``); one thread, one sequence. ``int8_activations``:
    quantized weights times int8 activations, on the CPU's int8 dot product."""
    from ..compiler.artifact import compile_model
    from ..host import cpu_flags, described_cpu, host_isa, machine
    from ..model.config import load_config
    from ..model.weights import load_params
    from ..spec import RunSpec, SpecError, resolve_activations, resolve_weight_dtype
    from ..topology.plan import ExecPlan

    if described_cpu() is None:
        raise SystemExit("error: set SANDWICH_CPU to the target's description "
                         "(`python -m sandwich_tvm.host --describe > FILE` on it)")
    cfg = load_config(model)
    try:
        weight_dtype = resolve_weight_dtype(dtype, cpu_flags())[0]
        resolve_activations("int8" if int8_activations else "float32", weight_dtype, cpu_flags())
    except SpecError as err:
        raise SystemExit(f"error: {err}") from err
    spec = RunSpec(str(model), cfg, ExecPlan((0,), (0,), f"one thread on {machine()}"),
                   weight_dtype=weight_dtype, kv_dtype=kv_dtype, context=context, kv_tokens=context,
                   max_batch=1, prefill_chunk=context, int8_activations=int8_activations)
    out.mkdir(parents=True, exist_ok=True)
    compiled = compile_model(spec, out=out / "model", log=log)
    isa, layout_dtype = compiled.weight_layout
    params = load_params(model, cfg, compiled.params, isa, dtype=layout_dtype, layouts=compiled.layouts)
    np.savez(out / "params.npz", **{f"p{i}": storable(a) for i, a in enumerate(params)})
    manifest = {"format": FORMAT, "model": str(model), "machine": machine(), "isa": host_isa(),
                "kernel_isa": compiled.meta["kernel_isa"], "dtype": weight_dtype, "kv_dtype": kv_dtype,
                "int8_activations": int8_activations,
                "context": context, "vocab": cfg.vocab_size, "params": len(params),
                "param_dtypes": [str(a.dtype) for a in params]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(f"built {cfg.name} for {machine()} ({manifest['kernel_isa']}, {weight_dtype}) -> {out}")
    return manifest


def run(bundle: Path, prompt: list[int], steps: int) -> dict:
    """Prefill ``prompt`` and decode ``steps`` greedy tokens with the bundle's model; the logits
    of the prompt's last position and of each step (numpy and TVM's runtime only)."""
    import platform

    import tvm
    from tvm.runtime.vm import VirtualMachine  # (tvm.relax needs the compiler)

    from .. import host

    manifest = json.loads((bundle / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"error: {bundle} is not a crossmodel bundle of format {FORMAT}; rebuild it")
    if manifest["machine"] != platform.machine():
        raise SystemExit(f"error: {bundle} was built for {manifest['machine']}; this is {platform.machine()}")
    data = np.load(bundle / "params.npz")
    params = [tvm.runtime.tensor(restored(data, f"p{i}", kind))
              for i, kind in enumerate(manifest["param_dtypes"])]
    if len(prompt) + steps > manifest["context"]:
        raise SystemExit(f"error: a prompt of {len(prompt)} tokens and {steps} steps exceed the bundle's "
                         f"context of {manifest['context']} tokens; rebuild it with a larger --context")
    vm = VirtualMachine(tvm.runtime.load_module(str(bundle / "model" / "model.so")), tvm.cpu())
    g, shape = tvm.get_global_func, tvm.runtime.ShapeTuple
    kv = vm["create_paged_kv_cache"](shape([1]), shape([manifest["context"]]), shape([manifest["context"]]),
                                     shape([PAGE]), shape([0]))
    g("vm.builtin.kv_state_add_sequence")(kv, 0)
    begin, end = g("vm.builtin.kv_state_begin_forward"), g("vm.builtin.kv_state_end_forward")

    def step(fn, ids: list[int]):
        nonlocal kv
        begin(kv, shape([0]), shape([len(ids)]))
        logits, kv = fn(tvm.runtime.tensor(np.asarray([ids], dtype=np.int32)), kv, params)
        end(kv)
        return logits.numpy().reshape(-1, manifest["vocab"])[-1]

    rows = [step(vm["prefill"], prompt)]
    tokens = [int(rows[-1].argmax())]
    for _ in range(steps):
        rows.append(step(vm["decode"], tokens[-1:]))
        tokens.append(int(rows[-1].argmax()))
    flags = host.own_cpu_flags()  # the CPU this ran on
    return {"machine": platform.machine(), "isa": host.isa_of(flags), "emulated": host.emulated(),
            "cpu": host.own_cpuinfo().get("model name", "?"), "flags": sorted(flags),
            "tokens": tokens, "logits": np.stack(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandwich_tvm.bench.crossmodel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    b = verbs.add_parser("build", help="compile a model for the CPU SANDWICH_CPU describes")
    b.add_argument("--model", required=True, help="an HF directory, a GGUF file or a preset")
    b.add_argument("--out", type=Path, required=True, help="the bundle directory")
    b.add_argument("--dtype", default="float32", help="weight type (float32, bfloat16, q8_0, ...; auto)")
    b.add_argument("--kv-dtype", default="float32", help="KV cache type (float32, bfloat16, float16, int8)")
    b.add_argument("--context", type=int, default=128, help="KV cache tokens (default 128)")
    b.add_argument("--int8-activations", action="store_true",
                   help="quantized weights times int8 activations (the CPU's int8 dot product)")
    r = verbs.add_parser("run", help="prefill and decode greedily with each bundle's model")
    r.add_argument("bundles", type=Path, nargs="+")
    r.add_argument("--prompt", required=True, help="comma-separated token ids")
    r.add_argument("--steps", type=int, default=8, help="greedy decode steps (default 8)")
    r.add_argument("--out", type=Path, default=None,
                   help="a directory: each bundle's tokens and logits to NAME.npz (NAME: the bundle's)")
    args = parser.parse_args(argv)
    if args.verb == "build":
        from ..compiler.artifact import CompileError
        from ..host import HostError
        from ..model.config import ModelConfigError

        try:
            build(args.model, args.out, args.dtype, args.kv_dtype, args.context, args.int8_activations)
        except (CompileError, HostError, ModelConfigError) as err:  # a one-line error, not a traceback
            raise SystemExit(f"error: {err}") from err
        return 0
    for bundle in args.bundles:  # one process: TVM's import is the slow part under emulation
        result = run(bundle, [int(t) for t in args.prompt.split(",")], args.steps)
        emulated = f", {result['cpu']}" if result["emulated"] else ""
        where = f"{result['machine']} ({result['isa']}{emulated})"
        print(f"{bundle.name} tokens on {where}: {result['tokens']}", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            info = json.dumps({k: v for k, v in result.items() if k not in ("tokens", "logits")})
            np.savez(args.out / f"{bundle.name}.npz", tokens=np.asarray(result["tokens"]),
                     logits=result["logits"], info=info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
