"""The execution plan the runtime follows: how many processes, and which cores each one's
prefill and decode run on.

It comes from the plan search in-process (``RankedPlan.exec_plan``), from a plans.json the
user names (``--plan``; ``save_plans`` writes it, ``ExecPlan.from_file`` reads it: this module
owns the schema, ``PLANS_VERSION``), or, without one, one process on every CPU this process
may use for both phases. A plan of P = tp x pp processes is run as P ranks on Disco
(``runtime.tp``): ``pp`` pipeline stages of consecutive layers, each ``tp`` tensor-parallel
ranks (rank r is stage r // tp); rank 0's CPUs are ``prefill_cpus`` and ``decode_cpus``, every
rank's are in ``ranks``. With ``wa`` (weight-attention separation) one more process, the last
rank, holds the KV cache and runs attention; the others run every weight-centric operator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..collective.shm import MAX_RANKS
from ..host import PROCESS_CPUS, save_atomic

REPLAN = "re-run `python -m sandwich_tvm.tune plan`"
PLANS_VERSION = 3  # 3: "processes", "pp" and "wa"; 2: "version"; 1: neither (hand-written files)


class PlanError(ValueError):
    """A plan file we cannot follow on this machine."""


Cpus = tuple[int, ...]


@dataclass(frozen=True)
class ExecPlan:
    prefill_cpus: Cpus
    decode_cpus: Cpus
    source: str = "all CPUs"
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    ranks: tuple[tuple[Cpus, Cpus], ...] = ()  # every process's (prefill, decode) CPUs; () = one
    numa: tuple[tuple[int, ...], ...] = ()  # every process's NUMA nodes (its memory), when known
    pp: int = 1  # pipeline stages, each of ``tp`` ranks
    wa: bool = False  # weight-attention separation: the last rank holds the KV cache and attends
    oversubscribe: bool = False  # ranks may share CPUs: a layout tried on a smaller machine (slow)

    def __post_init__(self) -> None:
        if not self.ranks:
            object.__setattr__(self, "ranks", ((tuple(self.prefill_cpus), tuple(self.decode_cpus)),))
        if len(self.ranks) > MAX_RANKS:
            raise PlanError(f"a plan runs at most {MAX_RANKS} processes (one shared-memory group), not "
                            f"{len(self.ranks)}")
        if self.wa and (self.pp, len(self.ranks)) != (1, 2):
            raise PlanError(f"weight-attention separation runs one weight rank and one attention rank in "
                            f"this version (tp 1, pp 1, processes 2), not {len(self.ranks)} processes in "
                            f"pp {self.pp}")

    @property
    def processes(self) -> int:
        """Processes (ranks): ``tp`` x ``pp``, plus the attention rank with ``wa``."""
        return len(self.ranks)

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks of each pipeline stage (every weight process when ``pp`` is 1)."""
        return (len(self.ranks) - self.wa) // self.pp

    @property
    def parts(self) -> int:
        """Compiled models the ranks run: one per pipeline stage, or the weight side and the
        attention side with ``wa``; 0 when every rank runs the same model (a shard of it)."""
        return self.pp if self.pp > 1 else 2 if self.wa else 0

    @property
    def prefill_threads(self) -> int:
        return len(self.prefill_cpus)

    @property
    def decode_threads(self) -> int:
        return len(self.decode_cpus)

    @property
    def all_prefill_cpus(self) -> Cpus:
        """Every process's prefill CPUs, each once (ranks of an ``oversubscribe`` plan share some)."""
        return tuple(dict.fromkeys(c for p, _ in self.ranks for c in p))

    @property
    def all_decode_cpus(self) -> Cpus:
        """Every process's decode CPUs, each once."""
        return tuple(dict.fromkeys(c for _, d in self.ranks for c in d))

    def one_process(self) -> ExecPlan:
        """The same CPUs as one process (for a build that runs one: TVM's stock baseline)."""
        if self.processes == 1:
            return self
        return ExecPlan(self.all_prefill_cpus, self.all_decode_cpus, f"{self.source}, as one process")

    def rank(self, i: int) -> ExecPlan:
        """Process ``i``'s part: a one-process plan on its CPUs (and NUMA nodes)."""
        prefill, decode = self.ranks[i]
        return ExecPlan(prefill, decode, f"{self.source}, rank {i} of {self.processes}",
                        numa=self.numa[i:i + 1])

    def stage_of(self, rank: int) -> int:
        """The pipeline stage rank ``rank`` runs."""
        return rank // self.tp

    def part_of(self, rank: int) -> int:
        """Which of the ``parts`` rank ``rank`` runs: its stage, or with ``wa`` 0 (weights) or
        1 (attention, the last rank)."""
        if self.wa:
            return int(rank == self.processes - 1)
        return self.stage_of(rank)

    @classmethod
    def of_ranks(cls, ranks: list[tuple[Cpus, Cpus]], source: str, ttft: float | None = None,
                 tpot: float | None = None, numa: list[tuple[int, ...]] | None = None,
                 pp: int = 1, wa: bool = False, oversubscribe: bool = False) -> ExecPlan:
        """A plan of ``len(ranks)`` processes with these (prefill, decode) CPUs each, process i's
        memory on NUMA nodes ``numa[i]`` when given, in ``pp`` pipeline stages (``wa``: the last
        process is the attention rank)."""
        prefill, decode = ranks[0]
        return cls(tuple(prefill), tuple(decode), source, ttft, tpot,
                   tuple((tuple(p), tuple(d)) for p, d in ranks), tuple(tuple(n) for n in numa or ()), pp,
                   wa, oversubscribe)

    def describe(self) -> str:
        if self.processes == 1:
            return (f"prefill {self.prefill_threads} threads on CPUs {list(self.prefill_cpus)}, "
                    f"decode {self.decode_threads} on {list(self.decode_cpus)} ({self.source})")
        each = "; ".join(f"rank {i}: prefill {list(p)}, decode {list(d)}"
                         for i, (p, d) in enumerate(self.ranks))
        how = ("weight-attention separation: the last rank attends" if self.wa else "tensor parallel"
               if self.pp == 1 else
               f"{self.pp} pipeline stages" + (f" of {self.tp} tensor-parallel ranks" if self.tp > 1 else ""))
        return f"{self.processes} processes ({how}) -- {each} ({self.source})"

    @classmethod
    def all_cpus(cls) -> ExecPlan:
        cpus = tuple(sorted(PROCESS_CPUS))
        return cls(cpus, cpus)

    def to_dict(self) -> dict:
        """The plans.json entry ``from_dict`` reads back (predictions and NUMA nodes when known)."""
        d: dict = {"processes": self.processes, "tp": self.tp, "pp": self.pp,
                   **({"wa": True} if self.wa else {}),
                   **({"oversubscribe": True} if self.oversubscribe else {}),
                   "prefill_cpus": [list(p) for p, _ in self.ranks],
                   "decode_cpus": [list(dec) for _, dec in self.ranks], "source": self.source}
        if self.numa:
            d["numa"] = [list(n) for n in self.numa]
        if self.predicted_ttft_ms is not None:
            d["predicted_ttft_ms"] = self.predicted_ttft_ms
        if self.predicted_tpot_ms is not None:
            d["predicted_tpot_ms"] = self.predicted_tpot_ms
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str) -> ExecPlan:
        if not isinstance(d, dict):
            raise PlanError(f"{source}: the best plan is {_clip(d)}, not a JSON object; {REPLAN}")
        prefill, decode = _cpu_lists(d, "prefill_cpus", source), _cpu_lists(d, "decode_cpus", source)
        pp, wa = d.get("pp", 1), d.get("wa", False)
        if type(pp) is not int or pp < 1:
            raise PlanError(f"{source}: pp (pipeline stages) is {_clip(pp)}, not a positive integer; "
                            f"{REPLAN}")
        if type(wa) is not bool:
            raise PlanError(f"{source}: wa (weight-attention separation) is {_clip(wa)}, not true or false")
        shared = d.get("oversubscribe", False)
        if type(shared) is not bool:
            raise PlanError(f"{source}: oversubscribe (ranks sharing CPUs) is {_clip(shared)}, not true or "
                            "false")
        tp = d.get("tp")
        if tp is None:  # written as processes (and pp)
            processes = d.get("processes", len(prefill))
            tp = (processes - wa) // pp if type(processes) is int else None
        else:
            processes = d.get("processes", tp * pp + wa if type(tp) is int else None)
        if type(tp) is not int or type(processes) is not int or tp < 1 or tp * pp + wa != processes:
            extra = " plus the attention rank" if wa else ""
            raise PlanError(f"{source}: the plan says {_clip(processes)} processes, tp {_clip(tp)} and pp "
                            f"{pp}; processes must be tp x pp{extra}; {REPLAN}")
        if len(prefill) != processes or len(decode) != processes:
            stages = f" x pp {pp}" if pp > 1 else ""
            raise PlanError(f"{source}: the plan says tp {tp}{stages} but lists CPUs for {len(prefill)} "
                            f"prefill and {len(decode)} decode processes; {REPLAN}")
        numa = d.get("numa")
        if numa is not None and (not isinstance(numa, list) or len(numa) != processes or not all(
                isinstance(n, list) and n and all(type(x) is int and x >= 0 for x in n) for n in numa)):
            raise PlanError(f"{source}: numa of the best plan is {_clip(numa)}, not one list of NUMA node "
                            f"ids per process; {REPLAN}")
        try:
            plan = cls.of_ranks(list(zip(prefill, decode, strict=True)), source,
                                d.get("predicted_ttft_ms"), d.get("predicted_tpot_ms"), numa, pp, wa, shared)
        except PlanError as err:
            raise PlanError(f"{source}: {err}") from None
        every = [c for p, dec in plan.ranks for c in p + dec]
        outside = sorted(set(every) - PROCESS_CPUS)
        if outside:
            raise PlanError(f"{source}: CPUs {outside} are not available to this process (it may use "
                            f"{sorted(PROCESS_CPUS)}); the plan was made for another machine: {REPLAN}")
        for i, (p, dec) in enumerate(plan.ranks):
            if not set(dec) <= set(p):
                raise PlanError(f"{source}: decode CPUs must be a subset of the prefill CPUs (process {i}); "
                                f"{REPLAN}")
        claimed = [c for p, _ in plan.ranks for c in p]
        if len(set(claimed)) != len(claimed) and not shared:
            raise PlanError(f"{source}: two processes share a CPU ({sorted(claimed)}); {REPLAN} (or, to "
                            "try the layout on fewer cores, slowly, set \"oversubscribe\": true)")
        if len({(len(p), len(dec)) for p, dec in plan.ranks}) > 1:
            raise PlanError(f"{source}: the processes have different thread counts; every rank's model is "
                            f"compiled for rank 0's, so they must match; {REPLAN}")
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
        version = data.get("version", 1) if isinstance(data, dict) else None
        if isinstance(version, int) and version > PLANS_VERSION:
            raise PlanError(f"{path} was written by a newer sandwich-tvm (plans.json version {version}; this "
                            f"one reads up to {PLANS_VERSION}); upgrade, or {REPLAN}")
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


def _cpu_lists(d: dict, key: str, source: str) -> list[Cpus]:
    """Every process's CPUs under `key`: non-empty lists of distinct CPU ids."""
    lists = d.get(key)
    if (not isinstance(lists, list) or not lists
            or not all(isinstance(cpus, list) and cpus for cpus in lists)):
        raise PlanError(f"{source}: {key} of the best plan is {_clip(lists)}, not a non-empty list of "
                        f"CPU lists; {REPLAN}")
    for cpus in lists:
        if not all(type(c) is int and c >= 0 for c in cpus) or len(set(cpus)) != len(cpus):
            raise PlanError(f"{source}: {key} of the best plan holds {_clip(cpus)}, not distinct CPU ids; "
                            f"{REPLAN}")
    return [tuple(cpus) for cpus in lists]


def save_plans(path: Path, plans: list[ExecPlan], details: list[dict] | None = None,
               **about: object) -> Path:
    """Write the ranked ``plans`` (best first) as a plans.json that ``ExecPlan.from_file`` reads,
    atomically. ``details`` (one dict per plan: how the search described it) and ``about`` (the
    machine, the model, the profile) ride along for people; the reader needs neither."""
    extras = details or [{} for _ in plans]
    entries = [extra | p.to_dict() for p, extra in zip(plans, extras, strict=True)]
    doc = {"version": PLANS_VERSION, **about, "plans": entries}
    save_atomic(Path(path), json.dumps(doc, indent=2))
    return Path(path)
