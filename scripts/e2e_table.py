"""Print the markdown table the README quotes from a `bench e2e --json` result.

    python -m sandwich_tvm.bench e2e --model llama-160m --json > out/e2e.json
    python scripts/e2e_table.py out/e2e.json
"""

from __future__ import annotations

import json
import sys


def table(result: dict) -> str:
    rows = result["rows"]

    def get(system: str, prompt: int) -> dict | None:
        return next((r for r in rows if r["system"] == system and r["prompt"] == prompt), None)

    dt = result.get("dtype", "float32")
    cpp_dt = next((r.get("weights", dt) for r in rows if r["system"] == "llama.cpp"), dt)
    out = [f"| prompt | Sandwich ({dt}) TTFT / TPOT ms | llama.cpp ({cpp_dt} GGUF) TTFT / TPOT ms "
           "| TTFT ratio | TPOT ratio | torch TTFT / TPOT ms | TTFT / TPOT vs torch "
           "| simulator TTFT / TPOT ms |",
           "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["system"] == "sandwich"):
        p = r["prompt"]
        cpp, pt = get("llama.cpp", p), get("torch", p)

        def pair(x: dict | None) -> str:
            return f"{x['ttft_ms']:.0f} / {x['tpot_ms']:.2f}" if x else "-"

        ratio = "- | -"
        if cpp:  # the benchmark's paired ratios (median of per-round ratios) when it has them
            tt = r.get("ttft_ratio_vs_llamacpp", r["ttft_ms"] / cpp["ttft_ms"])
            tp = r.get("tpot_ratio_vs_llamacpp", r["tpot_ms"] / cpp["tpot_ms"])
            ratio = f"{tt:.2f} | {tp:.2f}"
        vs_torch = (f"{r['ttft_ratio_vs_torch']:.2f} / {r['tpot_ratio_vs_torch']:.2f}"
                    if "ttft_ratio_vs_torch" in r else "-")
        out.append(f"| {p} | {pair(r)} | {pair(cpp)} | {ratio} | {pair(pt)} | {vs_torch} | "
                   f"{r['predicted_ttft_ms']:.0f} / {r['predicted_tpot_ms']:.2f} |")
    return "\n".join(out)


def dtype_table(result: dict) -> str:
    """The main run against its ``--also-dtype`` rows: TPOT of one over the other, paired."""
    also, main = result["also_dtype"], result.get("dtype", "float32")
    rows = result["rows"]
    out = [f"| prompt | Sandwich {main} TTFT / TPOT ms | Sandwich {also} TTFT / TPOT ms | "
           f"{main} / {also} TTFT, TPOT |", "|---|---|---|---|"]
    for r in (r for r in rows if r["system"] == f"sandwich {also}"):
        base = next(b for b in rows if b["system"] == "sandwich" and b["prompt"] == r["prompt"])
        out.append(f"| {r['prompt']} | {base['ttft_ms']:.0f} / {base['tpot_ms']:.2f} | {r['ttft_ms']:.0f} / "
                   f"{r['tpot_ms']:.2f} | {1 / r['ttft_ratio_vs_sandwich']:.2f}x, "
                   f"**{1 / r['tpot_ratio_vs_sandwich']:.2f}x** |")
    return "\n".join(out)


if __name__ == "__main__":
    for i, path in enumerate(sys.argv[1:]):
        with open(path) as fh:
            result = json.load(fh)
        if i:
            print()
        print(table(result))
        if result.get("also_dtype"):
            print()
            print(dtype_table(result))
