"""The README's GEMM table from `bench gemm --json` outputs (fp32, or 16-bit: `--dtype` runs,
compared with torch in the same dtype).

    python scripts/gemm_table.py out/bench_qkv.json out/bench_o.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(name: str, r: dict) -> str:
    by_m = {x["m"]: x for x in r["rows"]}
    low = min(r["rows"], key=lambda x: x["ratio_vs_best"])
    big = [m for m in (128, 256, 512) if m in by_m]
    gflops = " / ".join(f"{by_m[m]['sandwich_gflops']:.0f}" for m in big)
    peak = " / ".join(f"{by_m[m]['fma_peak_fraction']:.2f}" for m in big)
    ratios = " / ".join(f"{by_m[m]['ratio_vs_best']:.2f}" for m in big)
    one = by_m.get(1)
    m1 = (f"{one['sandwich_gflops']:.1f} / {one['numpy_gflops']:.1f} / {one['torch_gflops']:.1f}"
          if one else "-")
    return (f"| {name} {r['n']} x {r['k']} | {r['geomean_ratio']:.2f}x | {low['ratio_vs_best']:.2f}x "
            f"({low['m']}) | {ratios} | {gflops} ({peak}) | {r['fma_peak_gflops']:.0f} | {m1} |")


def row16(name: str, r: dict) -> str:
    by_m = {x["m"]: x for x in r["rows"]}
    low = min(r["rows"], key=lambda x: x["ratio_vs_torch"])
    some = [m for m in (1, 8, 64, 512) if m in by_m]
    ratios = " / ".join(f"{by_m[m]['ratio_vs_torch']:.2f}" for m in some)
    gflops = " / ".join(f"{by_m[m]['sandwich_gflops']:.0f}" for m in some)
    torch = " / ".join(f"{by_m[m]['torch_gflops']:.0f}" for m in some)
    return (f"| {name} {r['n']} x {r['k']} | {r['kernel_isa']} | {r['geomean_vs_torch']:.2f}x | "
            f"{low['ratio_vs_torch']:.2f}x ({low['m']}) | {ratios} | {gflops} | {torch} | "
            f"{r['fma_peak_gflops']:.0f} |")


def main(paths: list[str]) -> None:
    results = [(Path(p).stem.removeprefix("bench_"), json.loads(Path(p).read_text())) for p in paths]
    if results and results[0][1].get("dtype", "float32") != "float32":
        dtype = results[0][1]["dtype"]
        print(f"| GEMM (n x k) | kernels | geomean vs torch {dtype} | lowest ratio (m) "
              "| ratio at m = 1 / 8 / 64 / 512 | Sandwich GFLOPS at m = 1 / 8 / 64 / 512 "
              f"| torch {dtype} GFLOPS | fp32 FMA peak |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in results:
            print(row16(name, r))
        return
    print("| GEMM (n x k) | geomean vs best library | lowest ratio (m) | ratio at m = 128 / 256 / 512 "
          "| GFLOPS at m = 128 / 256 / 512 (of FMA peak) | FMA peak "
          "| m = 1 GFLOPS Sandwich / numpy / torch |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results:
        print(row(name, r))


if __name__ == "__main__":
    main(sys.argv[1:])
