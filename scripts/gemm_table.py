"""The README's GEMM table from `bench gemm --json` outputs.

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


def main(paths: list[str]) -> None:
    print("| GEMM (n x k) | geomean vs best library | lowest ratio (m) | ratio at m = 128 / 256 / 512 "
          "| GFLOPS at m = 128 / 256 / 512 (of FMA peak) | FMA peak "
          "| m = 1 GFLOPS Sandwich / numpy / torch |")
    print("|---|---|---|---|---|---|---|")
    for p in paths:
        name = Path(p).stem.removeprefix("bench_")
        print(row(name, json.loads(Path(p).read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
