"""The execution plan the runtime follows: which cores prefill and decode run on.

It comes from the plan stage (``out/plans.json``, the best-ranked Sandwich plan) or, without
one, every CPU this process may use for both phases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..tvm_compat import PROCESS_CPUS

REPLAN = "re-run `python -m sandwich_tvm.tune plan`"
DEFAULT_PLAN = Path("out/plans.json")


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
        if not isinstance(d, dict):
            raise PlanError(f"{source}: the best plan is {_clip(d)}, not a JSON object; {REPLAN}")
        tp = d.get("tp", d.get("processes", 1))
        if tp != 1:
            raise PlanError(f"{source}: the plan uses {tp} processes (tensor parallelism); this "
                            "runtime serves one process. Re-plan with a single-process plan.")
        plan = cls(_cpus(d, "prefill_cpus", source), _cpus(d, "decode_cpus", source), source,
                   d.get("predicted_ttft_ms"), d.get("predicted_tpot_ms"))
        usable = PROCESS_CPUS
        outside = sorted(set(plan.prefill_cpus + plan.decode_cpus) - usable)
        if outside:
            raise PlanError(f"{source}: CPUs {outside} are not available to this process (it may use "
                            f"{sorted(usable)}); the plan was made for another machine: {REPLAN}")
        if not set(plan.decode_cpus) <= set(plan.prefill_cpus):
            raise PlanError(f"{source}: decode CPUs must be a subset of the prefill CPUs; {REPLAN}")
        return plan

    @classmethod
    def from_file(cls, path: Path) -> ExecPlan:
        path = Path(path)
        if path.is_dir():
            inside = path / "plans.json"
            hint = f"pass {inside}" if inside.is_file() else "pass the plans.json that `tune plan` wrote"
            raise PlanError(f"{path} is a directory, not a plans.json file; {hint}")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanError(f"{path}: no plan file; run `python -m sandwich_tvm.tune plan` first") from None
        except OSError as err:
            raise PlanError(f"{path} cannot be read ({err.strerror}); check its permissions") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise PlanError(f"{path} is not a plans.json written by `tune plan` (invalid JSON: {err}); "
                            f"{REPLAN}") from None
        plans = data.get("plans") if isinstance(data, dict) else None
        if not isinstance(plans, list):
            raise PlanError(f"{path} is not a plans.json written by `tune plan` (it has no \"plans\" list); "
                            f"{REPLAN}")
        if not plans:
            raise PlanError(f"{path} holds no plans; {REPLAN}")
        return cls.from_dict(plans[0], str(path))


def _clip(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _cpus(d: dict, key: str, source: str) -> tuple[int, ...]:
    """The first process's CPUs under `key`: a non-empty list of distinct CPU ids."""
    lists = d.get(key)
    if not isinstance(lists, list) or not lists or not isinstance(lists[0], list) or not lists[0]:
        raise PlanError(f"{source}: {key} of the best plan is {_clip(lists)}, not a non-empty list of "
                        f"CPU lists; {REPLAN}")
    cpus = lists[0]
    if not all(type(c) is int and c >= 0 for c in cpus) or len(set(cpus)) != len(cpus):
        raise PlanError(f"{source}: {key} of the best plan holds {_clip(cpus)}, not distinct CPU ids; "
                        f"{REPLAN}")
    return tuple(cpus)


def resolve_plan(path: Path | None) -> ExecPlan:
    """``--plan FILE``, else ``out/plans.json`` when present, else every CPU for both phases.

    A default file that exists but cannot be followed is an error, not a silent fallback.
    """
    if path is not None:
        return ExecPlan.from_file(path)
    if not DEFAULT_PLAN.exists():
        return ExecPlan.all_cpus()
    try:
        return ExecPlan.from_file(DEFAULT_PLAN)
    except PlanError as err:
        detail = str(err).removesuffix(f"; {REPLAN}").rstrip(".")
        raise PlanError(f"{detail} -- {DEFAULT_PLAN} is read when --plan is not given: "
                        f"re-run `python -m sandwich_tvm.tune plan`, delete {DEFAULT_PLAN} to use every "
                        "CPU, or pass --plan FILE") from None
