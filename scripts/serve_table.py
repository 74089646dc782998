"""Print the markdown tables the README quotes from `bench serve` results.

    python -m sandwich_tvm.bench serve --model llama-160m --mode poisson --out out/serve
    python scripts/serve_table.py out/serve/serve_llama-160m_poisson.json

Per rate and system: P50/P90 TTFT and TPOT, output tokens/s, SLO attainment; the ratios are
Sandwich over llama-server in the same run (< 1: Sandwich lower). Then goodput per SLO scale
and the smallest scale at which each system reaches 90% at some rate.
"""

from __future__ import annotations

import json
import sys

OURS, BASE = "sandwich", "llamacpp"


def _f(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def tables(doc: dict) -> str:
    systems = doc["systems"]
    ours, base = systems.get(OURS, {}), systems.get(BASE, {})
    slo = doc["slo"]
    out = [f"{doc['model_name']}, {doc['mode']}; SLO TTFT {slo['ttft_ms']:g} ms / TPOT {slo['tpot_ms']:g} ms "
           f"({slo.get('source', '')}); workload {doc['workload']['source']}, "
           f"mean {doc['workload']['mean_prompt_tokens']:.0f} prompt / "
           f"{doc['workload']['mean_output_tokens']:.0f} output tokens", "",
           "| rate (req/s) | system | ok/sent | TTFT p50 / p90 ms | TPOT p50 / p90 ms | out tok/s "
           "| attainment | P90 TTFT ratio | P90 TPOT ratio | tok/s ratio |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base_runs = {r["rate"]: r for r in base.get("runs", [])}
    for name, s in ((OURS, ours), (BASE, base)):
        for r in s.get("runs", []):
            b = base_runs.get(r["rate"]) if name == OURS else None
            ratios = ("- | - | -" if b is None else
                      f"{_ratio(r['ttft_ms']['p90'], b['ttft_ms']['p90'])} | "
                      f"{_ratio(r['tpot_ms']['p90'], b['tpot_ms']['p90'])} | "
                      f"{_ratio(r['output_tokens_per_s'], b['output_tokens_per_s'])}")
            rate = "single" if r["rate"] is None else f"{r['rate']:g}"
            out.append(f"| {rate} | {name} | {r['ok']}/{r['sent']} | {_f(r['ttft_ms']['p50'])} / "
                       f"{_f(r['ttft_ms']['p90'])} | {_f(r['tpot_ms']['p50'], '.1f')} / "
                       f"{_f(r['tpot_ms']['p90'], '.1f')} | {_f(r['output_tokens_per_s'], '.1f')} | "
                       f"{_f(100 * r['attainment'] if r['attainment'] is not None else None)}% | {ratios} |")
    scales = [f"{x:g}" for x in doc["slo_scales"]]
    out += ["", "| system | " + " | ".join(f"x{k}" for k in scales) + " | first scale at 90% |",
            "|---|" + "---|" * (len(scales) + 1)]
    for name, s in systems.items():
        if doc["mode"] == "single":
            cells = [_f(100 * s["attainment_by_scale"][k][0], ".0f") + "%" for k in scales]
        else:
            cells = [_f(s["goodput_by_scale"][k], "g") for k in scales]
        out.append(f"| {name} | " + " | ".join(cells) + f" | {_f(s.get('min_slo_scale'), 'g')} |")
    return "\n".join(out)


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as fh:
            print(tables(json.load(fh)))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
