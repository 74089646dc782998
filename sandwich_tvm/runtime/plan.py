"""The execution plan the runtime follows: which cores prefill and decode run on.

It comes from the plan stage (``out/plans.json``, the best-ranked Sandwich plan) or, without
one, every CPU this process may use for both phases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..tvm_compat import PROCESS_CPUS


class PlanError(ValueError):
    """A plan file we cannot follow on this machine."""


@dataclass(frozen=True)
class ExecPlan:
    prefill_cpus: tuple[int, ...]
    decode_cpus: tuple[int, ...]
    source: str = "all CPUs"
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None

    @property
    def prefill_threads(self) -> int:
        return len(self.prefill_cpus)

    @property
    def decode_threads(self) -> int:
        return len(self.decode_cpus)

    def describe(self) -> str:
        return (f"prefill {self.prefill_threads} threads on CPUs {list(self.prefill_cpus)}, "
                f"decode {self.decode_threads} on {list(self.decode_cpus)} ({self.source})")

    @classmethod
    def all_cpus(cls) -> ExecPlan:
        cpus = tuple(sorted(PROCESS_CPUS))
        return cls(cpus, cpus)

    @classmethod
    def from_dict(cls, d: dict, source: str) -> ExecPlan:
        if d.get("tp", d.get("processes", 1)) != 1:
            raise PlanError(f"{source}: the plan uses {d['tp']} processes (tensor parallelism); this "
                            "runtime serves one process. Re-plan with a single-process plan.")
        plan = cls(tuple(d["prefill_cpus"][0]), tuple(d["decode_cpus"][0]), source,
                   d.get("predicted_ttft_ms"), d.get("predicted_tpot_ms"))
        usable = PROCESS_CPUS
        outside = sorted(set(plan.prefill_cpus + plan.decode_cpus) - usable)
        if outside:
            raise PlanError(f"{source}: CPUs {outside} are not available to this process (it may use "
                            f"{sorted(usable)}); the plan was made for another machine. Re-run "
                            "`python -m sandwich_tvm.tune plan`.")
        if not set(plan.decode_cpus) <= set(plan.prefill_cpus):
            raise PlanError(f"{source}: decode CPUs must be a subset of the prefill CPUs")
        return plan

    @classmethod
    def from_file(cls, path: Path) -> ExecPlan:
        try:
            data = json.loads(Path(path).read_text())
            best = data["plans"][0]
        except FileNotFoundError:
            raise PlanError(f"{path}: no plan file; run `python -m sandwich_tvm.tune plan` first") from None
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            raise PlanError(f"{path} is not a plans.json written by `tune plan` ({err})") from err
        return cls.from_dict(best, str(path))


def resolve_plan(path: Path | None) -> ExecPlan:
    """``--plan FILE``, else ``out/plans.json`` when present, else every CPU for both phases."""
    if path is not None:
        return ExecPlan.from_file(path)
    default = Path("out/plans.json")
    if default.is_file():
        try:
            return ExecPlan.from_file(default)
        except PlanError:
            pass
    return ExecPlan.all_cpus()
