"""Write the default schedules (``kernels/defaults.py``) of a model's GEMMs as kernel records.

A change of the defaults is timed against the defaults before it in one paired run: at the old
revision, write the old defaults as records; at the new one, time the model with no records
against them::

    python scripts/default_records.py --model llama-3.2-1b --dtype q8_0 --out out/old-defaults
    mkdir -p out/no-records
    python -m sandwich_tvm.bench e2e --model llama-3.2-1b --dtype q8_0 --systems sandwich \\
        --records out/no-records --also-records out/old-defaults --prompts 512 --new-tokens 64

The records hold every default bucket up to ``--max-m`` for this CPU and thread count, marked
as not measured (``gflops`` NaN, ``searched`` false).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> int:
    from sandwich_tvm.host import host_signature
    from sandwich_tvm.kernels.database import KernelRecord, save_record
    from sandwich_tvm.kernels.defaults import default_buckets
    from sandwich_tvm.kernels.search import Tuned
    from sandwich_tvm.model.linear import KernelSet
    from sandwich_tvm.model.shapes import linear_shapes
    from sandwich_tvm.spec import resolve_run_spec

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-m", type=int, default=512)
    p.add_argument("--out", type=Path, required=True, help="records directory to write")
    args = p.parse_args()
    spec = resolve_run_spec(args.model, dtype=args.dtype)
    kernels = KernelSet(args.threads, args.threads, dtype=spec.weight_dtype,
                        int8_activations=spec.int8_activations)
    cpu = host_signature()
    for name, shape in linear_shapes(spec.config, spec.weight_dtype, wider=spec.wider_linears).items():
        rec = KernelRecord(shape, args.threads, cpu)
        low = 1
        for b in default_buckets(shape, args.threads, None, kernels.kernel_isa_for(shape.dtype)):
            rec.add(Tuned(low, b.schedule, float("nan"), False))
            low = b.m_max + 1
            if low > args.max_m:
                break
        rec.add(Tuned(args.max_m, rec.tuned[-1].schedule, float("nan"), False))
        path = save_record(rec, args.out)
        print(f"{name}: {len(rec.buckets())} default schedules -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
