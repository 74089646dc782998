"""From request records to the paper's serving metrics: percentiles, SLO attainment, goodput.

A request attains the SLO when it succeeded with TTFT <= the TTFT SLO and TPOT <= the TPOT
SLO; attainment is over the requests sent (failures are misses). Goodput is the highest tested
request rate whose attainment reaches the 90% goal (Zhong et al., as the paper). The SLO-scale
sweep (Fig. 9) multiplies both SLOs by a scale: lower is more stringent. A rate run in several
rounds is reported over all its rounds' requests, each round listed too; ``paired`` gives each
system's P90 latencies over the first system's, round by round, and their medians.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from ...host import save_atomic
from .client import RequestRecord, RunResult

GOAL = 0.9  # the SLO attainment goal (P90)
DEFAULT_SCALES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
PERCENTILES = (50, 90, 99)
BILLION = 0.9e9  # TinyLlama-1.1B and Llama-3.2-1B are "1B-class"; a 160M model is not
EIGHT_BILLION = 5e9


@dataclass(frozen=True)
class Slo:
    """Latency objectives in milliseconds."""

    ttft_ms: float
    tpot_ms: float

    def scaled(self, scale: float) -> Slo:
        return Slo(self.ttft_ms * scale, self.tpot_ms * scale)


def default_slo(num_params: int, mode: str) -> tuple[Slo, str]:
    """The paper's SLOs (Sec. 8.3) for a model of this size and serving mode, and where they come
    from. Batched: 160M 200/100 ms, 1.3B 2000/280 ms (also used for larger models). Single
    sequence: 1.3B 2200/70 ms, 8B 8000/240 ms (the 160M model has none: its batched ones)."""
    if mode == "single" and num_params >= EIGHT_BILLION:
        return Slo(8000, 240), "paper, single-sequence 8B"
    if mode == "single" and num_params >= BILLION:
        return Slo(2200, 70), "paper, single-sequence 1.3B"
    if num_params >= BILLION:
        return Slo(2000, 280), "paper, batched 1.3B"
    return Slo(200, 100), "paper, batched 160M"


def percentiles(values: Iterable[float], qs: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """{'p50': ..., 'p90': ..., 'p99': ...} (linear interpolation); None for no values."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return {f"p{q}": (float(np.percentile(arr, q)) if arr.size else None) for q in qs}


def meets(rec: RequestRecord, slo: Slo) -> bool:
    """Whether one request attained the SLO (a one-token request has no TPOT to miss)."""
    if not (rec.sent and rec.ok) or rec.ttft_s is None:
        return False
    tpot = rec.tpot_s
    return rec.ttft_s * 1e3 <= slo.ttft_ms and (tpot is None or tpot * 1e3 <= slo.tpot_ms)


def attainment(records: Sequence[RequestRecord], slo: Slo) -> float | None:
    """The fraction of sent requests that attained the SLO; None when none was sent."""
    sent = [r for r in records if r.sent]
    return sum(meets(r, slo) for r in sent) / len(sent) if sent else None


def reaches_goal(att: float | None) -> bool:
    return att is not None and att >= GOAL - 1e-9  # 9 of 10 is exactly the goal


def goodput(points: Iterable[tuple[float | None, float | None]]) -> float | None:
    """The highest rate whose attainment reaches the goal, from (rate, attainment) pairs."""
    ok = [rate for rate, att in points if rate is not None and reaches_goal(att)]
    return max(ok) if ok else None


def scale_key(scale: float) -> str:
    return f"{scale:g}"


@dataclass
class SystemRuns:
    """One system's part of the benchmark: how it went and its runs, one per rate and round."""

    name: str
    status: str = "pending"  # pending | running | ok | skipped | failed
    reason: str | None = None
    command: list[str] | None = None
    runs: list[RunResult] = field(default_factory=list)


def _ms(values: Iterable[float | None]) -> dict[str, float | None]:
    vals = [v * 1e3 for v in values if v is not None]
    out = percentiles(vals)
    out["mean"] = float(np.mean(vals)) if vals else None
    return out


def summarize_run(run: RunResult, slo: Slo, scales: Sequence[float], with_requests: bool = True) -> dict:
    """Counts, latency percentiles (ms), throughput and attainment of one run."""
    recs = run.records
    ok = [r for r in recs if r.sent and r.ok]
    tokens = sum(r.output_tokens for r in ok)
    errors = Counter((r.error or "?")[:120] for r in recs if r.sent and not r.ok)
    out = {"rate": run.rate, "sent": sum(r.sent for r in recs), "not_sent": sum(not r.sent for r in recs),
           "ok": len(ok), "failed": sum(r.sent and not r.ok for r in recs), "wall_s": run.wall_s,
           "ttft_ms": _ms(r.ttft_s for r in ok), "tpot_ms": _ms(r.tpot_s for r in ok),
           "e2e_ms": _ms(r.e2e_s for r in ok), "output_tokens": tokens,
           "output_tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else None,
           "requests_per_s": len(ok) / run.wall_s if run.wall_s > 0 else None,
           "attainment": attainment(recs, slo),
           "attainment_by_scale": {scale_key(s): attainment(recs, slo.scaled(s)) for s in scales},
           "errors": dict(errors.most_common())}
    if with_requests:
        out["requests"] = [r.to_json() for r in recs]
    return out


def by_rate(runs: Sequence[RunResult]) -> list[list[RunResult]]:
    """The runs grouped by rate, in the order the rates first ran; each group in run order."""
    groups: dict[float | None, list[RunResult]] = {}
    for r in runs:
        groups.setdefault(r.rate, []).append(r)
    return list(groups.values())


def pooled(rounds: Sequence[RunResult]) -> RunResult:
    """One rate's rounds as one run: all their records, their wall times summed."""
    return RunResult(rounds[0].mode, rounds[0].rate, [x for r in rounds for x in r.records],
                     sum(r.wall_s for r in rounds), rounds[0].round)


def summarize_rate(rounds: Sequence[RunResult], slo: Slo, scales: Sequence[float],
                   with_requests: bool = True) -> dict:
    """``summarize_run`` over all the rounds of one rate, with each round's own summary."""
    out = summarize_run(pooled(rounds), slo, scales, with_requests=False)
    out["rounds"] = [{"round": r.round, **summarize_run(r, slo, scales, with_requests=False)} for r in rounds]
    spec = [r.speculative for r in rounds if r.speculative]
    if spec:  # acceptance and tokens per verified step over the rounds, from the server's counters
        total = {k: sum(x.get(k, 0.0) for x in spec) for k in spec[0]}
        out["speculative"] = {**total, "acceptance_rate": total["accepted"] / total["drafted"],
                              "tokens_per_step": (total["accepted"] + total["verified_steps"])
                              / max(total["verified_steps"], 1)}
    if with_requests:
        out["requests"] = [{**x.to_json(), "round": r.round} for r in rounds for x in r.records]
    return out


def _p90_ms(run: RunResult, key: str) -> float | None:
    ok = [r for r in run.records if r.sent and r.ok]
    return percentiles((getattr(r, f"{key}_s") * 1e3 for r in ok if getattr(r, f"{key}_s") is not None),
                       (90,))["p90"]


def paired_ratios(systems: Sequence[SystemRuns]) -> dict | None:
    """Each system's P90 TTFT and TPOT over the first system's at every rate, one ratio per
    round both ran it in (minutes apart), and their medians; None without two systems' runs."""
    ran = [s for s in systems if s.runs]
    if len(ran) < 2:
        return None
    base = ran[0]
    out: dict = {"base": base.name, "systems": {}}
    for s in ran[1:]:
        rows = []
        for group in by_rate(s.runs):
            pairs = [(b, o) for o in group for b in base.runs if (b.rate, b.round) == (o.rate, o.round)]
            if not pairs:
                continue
            row: dict = {"rate": group[0].rate, "rounds": [o.round for _, o in pairs]}
            for key in ("ttft", "tpot"):
                ratios = [None if a is None or not b else a / b
                          for a, b in ((_p90_ms(o, key), _p90_ms(b, key)) for b, o in pairs)]
                known = [x for x in ratios if x is not None]
                row[f"p90_{key}_ratio"] = float(np.median(known)) if known else None
                row[f"p90_{key}_ratio_by_round"] = ratios
            rows.append(row)
        out["systems"][s.name] = rows
    return out


def scale_sweep(runs: Sequence[RunResult], slo: Slo, scales: Sequence[float]) -> dict:
    """Attainment per scale and rate, goodput per scale, and the smallest scale at which some
    rate reaches the goal (None if no scale does)."""
    att = {scale_key(s): [attainment(r.records, slo.scaled(s)) for r in runs] for s in scales}
    good = {k: goodput(zip((r.rate for r in runs), v, strict=True)) for k, v in att.items()}
    first = next((s for s in sorted(scales) if any(reaches_goal(a) for a in att[scale_key(s)])), None)
    return {"attainment_by_scale": att, "goodput_by_scale": good, "min_slo_scale": first}


def build_report(meta: dict, systems: Sequence[SystemRuns], slo: Slo, slo_source: str,
                 scales: Sequence[float], with_requests: bool = True) -> dict:
    """The whole benchmark as one JSON document (see the module docstring for the metrics)."""
    doc = {"benchmark": "serve", **meta,
           "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "source": slo_source},
           "slo_goal": GOAL, "slo_scales": list(scales), "systems": {}, "goodput": {}}
    for s in systems:
        groups = by_rate(s.runs)
        rates = [pooled(g) for g in groups]
        sweep = scale_sweep(rates, slo, scales)
        doc["systems"][s.name] = {
            "status": s.status, "reason": s.reason, "command": s.command,
            "goodput": goodput((r.rate, attainment(r.records, slo)) for r in rates),
            **sweep, "runs": [summarize_rate(g, slo, scales, with_requests) for g in groups]}
        doc["goodput"][s.name] = sweep["goodput_by_scale"]
    doc["paired"] = paired_ratios(systems)
    return doc


def without_requests(doc: dict) -> dict:
    """The document without per-request records (for printing)."""
    out = json.loads(json.dumps(doc))
    for sys_doc in out["systems"].values():
        for run in sys_doc["runs"]:
            run.pop("requests", None)
    return out


def save_report(doc: dict, path: Path) -> None:
    save_atomic(path, json.dumps(doc, indent=1))


# --- presentation ----------------------------------------------------------------------------

def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _rate(rate: float | None) -> str:
    return "single" if rate is None else f"{rate:g}"


def render(doc: dict, console: Console) -> None:
    """Rich tables: one row per system and rate, then the SLO-scale sweep."""
    slo = doc["slo"]
    table = Table(title=f"serving {doc.get('model', '')} ({doc.get('mode', '')}); SLO TTFT "
                        f"{slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms ({slo['source']})")
    table.box, table.pad_edge = box.SIMPLE_HEAD, False
    for col in ("system", "rate\nreq/s", "ok/sent", "TTFT ms\np50/90/99", "TPOT ms\np50/90", "E2E ms\np90",
                "out\ntok/s", "SLO\natt."):
        table.add_column(col, justify="left" if col[:4] in ("syst", "rate") else "right", no_wrap=True)
    for name, s in doc["systems"].items():
        if not s["runs"]:
            table.add_row(name, "-", s["status"], *["-"] * 5)
        for r in s["runs"]:
            t, p, e = r["ttft_ms"], r["tpot_ms"], r["e2e_ms"]
            table.add_row(name, _rate(r["rate"]), f"{r['ok']}/{r['sent']}",
                          "/".join(_fmt(t[k]) for k in ("p50", "p90", "p99")),
                          "/".join(_fmt(p[k], ".1f") for k in ("p50", "p90")), _fmt(e["p90"]),
                          _fmt(r["output_tokens_per_s"], ".1f"), _pct(r["attainment"]))
    console.print(table)
    scales = [scale_key(s) for s in doc["slo_scales"]]
    single = doc.get("mode") == "single"
    sweep = Table(title="SLO-scale sweep: " + ("attainment" if single else "goodput (req/s)")
                        + f" per scale; min scale = the smallest reaching {GOAL:.0%}", box=box.SIMPLE_HEAD)
    for col in ("system", *[f"x{k}" for k in scales], "min scale"):
        sweep.add_column(col, justify="left" if col == "system" else "right")
    for name, s in doc["systems"].items():
        if single:
            cells = [_pct(s["attainment_by_scale"][k][0] if s["attainment_by_scale"][k] else None)
                     for k in scales]
        else:
            cells = [_fmt(s["goodput_by_scale"][k], "g") for k in scales]
        sweep.add_row(name, *cells, _fmt(s["min_slo_scale"], "g"))
    console.print(sweep)
    for name, s in doc["systems"].items():
        if s["status"] in ("skipped", "failed"):
            console.print(f"{name}: {s['status']}: {s['reason']}", soft_wrap=True, markup=False)
        elif not single:
            console.print(f"{name}: goodput {_fmt(s['goodput'], 'g')} req/s at SLO scale 1", markup=False)
    paired = doc.get("paired")
    for name, rows in (paired or {}).get("systems", {}).items():
        for r in rows:
            ttft, tpot = _fmt(r["p90_ttft_ratio"], ".2f"), _fmt(r["p90_tpot_ratio"], ".2f")
            console.print(f"{name} / {paired['base']} at {_rate(r['rate'])}: P90 TTFT {ttft}x, P90 TPOT "
                          f"{tpot}x (median over {len(r['rounds'])} paired rounds)", markup=False)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def plot_report(doc: dict, path: Path) -> Path:
    """One PNG of four panels. Poisson mode: attainment, P90 TTFT and P90 TPOT against the
    request rate, and goodput against the SLO scale. Single mode: attainment and the TTFT and TPOT
    percentiles per system, and attainment against the SLO scale (the paper's Fig. 9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = {n: s for n, s in doc["systems"].items() if s["runs"]}
    slo = doc["slo"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    if doc.get("mode") == "single":
        _plot_single(axes.flat, systems, slo, doc["slo_scales"])
    else:
        _plot_rates(axes.flat, systems, slo, doc["slo_scales"])
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(f"{doc.get('model', '')}: {doc.get('mode', '')} serving, SLO TTFT {slo['ttft_ms']:g} ms / "
                 f"TPOT {slo['tpot_ms']:g} ms")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def _plot_rates(axes, systems: dict, slo: dict, scales: list[float]) -> None:
    ax_att, ax_ttft, ax_tpot, ax_scale = axes
    for name, s in systems.items():
        rates = [r["rate"] for r in s["runs"]]
        ax_att.plot(rates, [_nan(r["attainment"]) for r in s["runs"]], marker="o", label=name)
        ax_ttft.plot(rates, [_nan(r["ttft_ms"]["p90"]) for r in s["runs"]], marker="o", label=name)
        ax_tpot.plot(rates, [_nan(r["tpot_ms"]["p90"]) for r in s["runs"]], marker="o", label=name)
        ax_scale.plot(scales, [_nan(s["goodput_by_scale"][scale_key(k)], zero=True) for k in scales],
                      marker="o", label=name)
    ax_att.axhline(GOAL, ls="--", c="grey")
    ax_att.set(ylabel="SLO attainment", ylim=(-0.02, 1.02), title="SLO attainment")
    ax_ttft.axhline(slo["ttft_ms"], ls="--", c="grey", label="SLO")
    ax_ttft.set(ylabel="P90 TTFT (ms)", yscale="log", title="P90 TTFT")
    ax_tpot.axhline(slo["tpot_ms"], ls="--", c="grey", label="SLO")
    ax_tpot.set(ylabel="P90 TPOT (ms)", yscale="log", title="P90 TPOT")
    rates = sorted({r["rate"] for s in systems.values() for r in s["runs"]})
    for ax in (ax_att, ax_ttft, ax_tpot):
        ax.set_xlabel("request rate (req/s)")
        if rates and max(rates) / min(rates) >= 8:
            ax.set_xscale("log")
            ax.minorticks_off()
        if rates:
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax_scale.set(xlabel="SLO scale (lower: more stringent)", ylabel="goodput (req/s; 0: none)",
                 title="goodput vs SLO scale", xscale="log")
    ax_scale.minorticks_off()
    ax_scale.set_xticks(scales, [f"{k:g}" for k in scales])


def _plot_single(axes, systems: dict, slo: dict, scales: list[float]) -> None:
    ax_att, ax_ttft, ax_tpot, ax_scale = axes
    names = list(systems)
    x = np.arange(len(names))
    ax_att.bar(x, [_nan(systems[n]["runs"][0]["attainment"]) for n in names], color="C0")
    ax_att.axhline(GOAL, ls="--", c="grey")
    ax_att.set(ylabel="SLO attainment", ylim=(0, 1.02), title="SLO attainment")
    for ax, key, limit, title in ((ax_ttft, "ttft_ms", slo["ttft_ms"], "TTFT"),
                                  (ax_tpot, "tpot_ms", slo["tpot_ms"], "TPOT")):
        for i, q in enumerate(PERCENTILES):
            ax.bar(x + (i - 1) * 0.25, [_nan(systems[n]["runs"][0][key][f"p{q}"]) for n in names], 0.25,
                   label=f"P{q}")
        ax.axhline(limit, ls="--", c="grey", label="SLO")
        ax.set(ylabel=f"{title} (ms)", yscale="log", title=f"{title} percentiles")
    for ax in (ax_att, ax_ttft, ax_tpot):
        ax.set_xticks(x, names)
    for name, s in systems.items():
        ax_scale.plot(scales, [_nan(s["attainment_by_scale"][scale_key(k)][0]) for k in scales],
                      marker="o", label=name)
    ax_scale.axhline(GOAL, ls="--", c="grey")
    ax_scale.set(xlabel="SLO scale (lower: more stringent)", ylabel="SLO attainment", ylim=(-0.02, 1.02),
                 title="attainment vs SLO scale", xscale="log")
    ax_scale.minorticks_off()
    ax_scale.set_xticks(scales, [f"{k:g}" for k in scales])


def _nan(v: float | None, zero: bool = False) -> float:
    return (0.0 if zero else float("nan")) if v is None else v
