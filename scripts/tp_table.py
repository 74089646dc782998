"""Print the README's tensor-parallel table from `bench e2e --also-plan ... --json` results.

    python -m sandwich_tvm.bench e2e --model llama-160m --plan examples/plans/two-cpus-tp1.json \\
        --also-plan examples/plans/two-cpus-tp2.json --systems sandwich --json > out/tp.json
    python scripts/tp_table.py out/tp.json [more.json ...]

Ratios are the run's paired medians (`ttft_ratio_vs_sandwich`, `tpot_ratio_vs_sandwich`); the
simulator's deviation is (prediction - measurement) / measurement.
"""

from __future__ import annotations

import json
import sys


def _deviation(row: dict, key: str) -> str:
    """The simulator's (prediction - measurement) / measurement of ``key`` (ttft or tpot)."""
    return f"{(row[f'predicted_{key}_ms'] - row[f'{key}_ms']) / row[f'{key}_ms']:+.0%}"


def rows(result: dict) -> list[str]:
    base = {r["prompt"]: r for r in result["rows"] if r["system"] == "sandwich"}
    out = []
    for r in result["rows"]:
        if not r["system"].startswith("sandwich tp") or r["prompt"] not in base:
            continue
        b = base[r["prompt"]]
        out.append(
            f"| {result['model']} | {r['prompt']} | {b['ttft_ms']:.0f} / {b['tpot_ms']:.2f} "
            f"| {r['ttft_ms']:.0f} / {r['tpot_ms']:.2f} "
            f"| {r['ttft_ratio_vs_sandwich']:.2f}x, **{r['tpot_ratio_vs_sandwich']:.2f}x** "
            f"| {r['predicted_ttft_ms']:.0f} / {r['predicted_tpot_ms']:.2f} "
            f"({_deviation(r, 'ttft')}, {_deviation(r, 'tpot')}) "
            f"| {'yes' if r.get('same_tokens_as_sandwich') else 'no'} |")
    return out


def main(paths: list[str]) -> None:
    print("| model | prompt | TP-1 TTFT / TPOT ms | TP-2 TTFT / TPOT ms | TP-2 / TP-1 TTFT, TPOT "
          "| simulator TP-2 TTFT / TPOT ms (vs measured) | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as fh:
            for line in rows(json.load(fh)):
                print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
