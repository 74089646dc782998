"""The configuration search: fundamental tree -> groups -> removes -> ranked Sandwich plans.

1. `explore_groups` enumerates latent structures (Merkle de-duplicated).
2. For each grouped tree G, every cross-section the model can run (a valid TP degree, or no
   more processes than layers: pipeline stages) is a prefill partition. A transformation
   tree of `remove`s grows from G; each removed tree R offers decode configurations at the
   cuts above its shallowest remove (same partition).
   A removed tree that improves no cut over its parent is not expanded further; trees
   already seen (same Merkle hash) are skipped.
3. Decode configurations are grouped by (process count, NUMA nodes); a group stops being
   evaluated after `patience` consecutive configurations that do not beat its best.
4. Every pair of two or more processes is also arranged as pipeline stages (``pp`` dividing
   the processes, each stage's ranks a valid TP degree) and, on two processes, with
   weight-attention separation (one weight rank, one attention rank), the paper's other plan
   dimensions.
5. Pairs (prefill, decode) are ranked by predicted mean request latency over the trace.

The exploration is bounded by `max_trees` TopoTrees generated (group() may spend half);
once spent, every grouped tree's own cuts are still ranked and `stats.bounded` is set.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..collective.shm import MAX_RANKS
from ..model.config import LlamaConfig
from .configs import SandwichPlan, ServiceConfig, cross_section, cross_sections
from .hwobj import TopologyError
from .profile import MachineProfile
from .simulator import LatencySimulator, Prediction, Trace
from .transforms import TreeBudget, explore_groups, remove, remove_candidates
from .tree import TopoTree

if TYPE_CHECKING:
    from .plan import ExecPlan

Progress = Callable[[str, int, int], None]
MAX_TREES = 20_000  # typical servers need under 8,000 (Milan 2x64c: ~7,000)


@dataclass(frozen=True)
class RankedPlan:
    plan: SandwichPlan
    prediction: Prediction

    def to_dict(self) -> dict:
        return {
            **self.plan.to_dict(),
            "predicted_ttft_ms": round(self.prediction.ttft_ms, 3),
            "predicted_tpot_ms": round(self.prediction.tpot_ms, 3),
            "predicted_latency_ms": round(self.prediction.latency_ms, 3),
        }

    def exec_plan(self, source: str = "TopoTree search") -> ExecPlan:
        """The plan the runtime follows: each process's prefill and decode CPUs and NUMA nodes,
        with the predictions (what ``ExecPlan.from_dict`` reads back from ``to_dict()``)."""
        from .plan import ExecPlan  # imports TVM (the CPUs this process may use); the search does not

        p = self.plan
        return ExecPlan.of_ranks(list(zip(p.prefill.processes, p.decode.processes, strict=True)), source,
                                 round(self.prediction.ttft_ms, 3), round(self.prediction.tpot_ms, 3),
                                 list(p.prefill.domains), pp=p.prefill.pp, wa=p.prefill.wa)


@dataclass
class SearchStats:
    group_trees_generated: int = 0
    group_trees_unique: int = 0
    remove_trees_generated: int = 0
    remove_trees_unique: int = 0
    remove_trees_pruned: int = 0
    configs_evaluated: int = 0
    configs_skipped_early_stop: int = 0
    cuts_rejected_tp: int = 0
    groups_early_stopped: int = 0
    max_trees: int | None = None
    bounded: bool = False  # max_trees was reached: the search stopped early
    seconds: float = 0.0


@dataclass
class SearchResult:
    tree: TopoTree
    plans: list[RankedPlan]
    stats: SearchStats
    simulator: LatencySimulator = field(repr=False)


@dataclass
class _EarlyStop:
    """Patience per process group (same process count and NUMA nodes)."""

    patience: int
    best: dict[tuple, float] = field(default_factory=dict)
    misses: dict[tuple, int] = field(default_factory=dict)
    stopped: set[tuple] = field(default_factory=set)

    def allows(self, group: tuple) -> bool:
        return group not in self.stopped

    def report(self, group: tuple, cost: float) -> None:
        if cost < self.best.get(group, float("inf")):
            self.best[group], self.misses[group] = cost, 0
            return
        self.misses[group] = self.misses.get(group, 0) + 1
        if self.misses[group] >= self.patience:
            self.stopped.add(group)


def search_plans(tree: TopoTree, model: LlamaConfig, profile: MachineProfile, trace: Trace, *,
                 top_k: int = 10, patience: int = 32, max_group_levels: int = 2,
                 power_of_two: bool = True, max_trees: int | None = MAX_TREES,
                 progress: Progress | None = None, max_tp: int | None = None, weight_bytes: float = 4,
                 kv_bytes: float = 4, head_bytes: float | None = None,
                 decode_kernels: dict | None = None) -> SearchResult:
    """Explore `tree` and return the top-k Sandwich plans by predicted request latency of a run
    whose weights and KV cache take `weight_bytes` and `kv_bytes` per element (the lm_head
    `head_bytes`, default `weight_bytes`); `decode_kernels`: the decode GEMMs' measured times
    per thread count (`simulator.measured_decode_kernels`), a floor under the roofline.

    At most `max_trees` TopoTrees are generated (None: no bound); `stats.bounded` tells
    whether the bound cut the exploration short. `max_tp` bounds the processes of a plan.
    """
    if top_k < 1 or patience < 1 or max_group_levels < 0 or (max_trees is not None and max_trees < 1):
        raise ValueError(f"search_plans: top_k ({top_k}), patience ({patience}) and max_trees "
                         f"({max_trees}) must be >= 1, max_group_levels ({max_group_levels}) >= 0")
    start = time.perf_counter()
    stats = SearchStats(max_trees=max_trees)
    sim = LatencySimulator(tree, profile, model, trace, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                           head_bytes=head_bytes, decode_kernels=decode_kernels)
    group_budget = TreeBudget(None if max_trees is None else max_trees // 2)
    grouped, stats.group_trees_generated = explore_groups(
        tree, max_new_levels=max_group_levels, power_of_two=power_of_two, budget=group_budget)
    spent = stats.group_trees_generated - 1  # the fundamental tree is free
    budget = TreeBudget(None if max_trees is None else max_trees - spent)
    stats.group_trees_unique = len(grouped)
    stop = _EarlyStop(patience)
    decode_cost: dict[tuple, float] = {}
    pairs: dict[tuple, SandwichPlan] = {}
    seen: set[str] = set()

    def evaluate(decode: ServiceConfig) -> float | None:
        if decode.key in decode_cost:
            return decode_cost[decode.key]
        if not stop.allows(decode.group_key):
            stats.configs_skipped_early_stop += 1
            return None
        # a cut no TP degree allows runs as stages: score it as the runtime would run it
        n = len(decode.processes)
        runs = decode if model.tp_degrees_ok(n) else replace(decode, pp=n)
        cost = decode_cost[decode.key] = sim.decode_cost(runs)
        stats.configs_evaluated += 1
        stop.report(decode.group_key, cost)
        return cost

    for done, g_tree in enumerate(grouped):
        if progress:
            progress("trees", done, len(grouped))
        cuts = {}
        for depth in range(g_tree.height + 1):
            config = cross_section(g_tree, depth)
            if runnable(model, len(config.processes)) and (max_tp is None or config.tp <= max_tp):
                cuts[depth] = config
            else:
                stats.cuts_rejected_tp += 1
        if not cuts or g_tree.merkle in seen:
            continue
        seen.add(g_tree.merkle)
        shallowest = min(cuts)
        queue: deque[tuple[TopoTree, dict[int, float] | None]] = deque([(g_tree, None)])
        while queue:
            r_tree, parent_scores = queue.popleft()
            stats.remove_trees_unique += 1
            limit = r_tree.height if r_tree.removed_at is None else r_tree.removed_at - 1
            scores = {}
            for depth, prefill in cuts.items():
                if depth > limit:
                    continue
                decode = cross_section(r_tree, depth)
                cost = evaluate(decode)
                if cost is None:
                    continue
                scores[depth] = cost
                pairs.setdefault((prefill.key, decode.key),
                                 SandwichPlan(prefill, decode, r_tree.history))
            improved = parent_scores is None or any(
                cost < parent_scores.get(d, float("inf")) for d, cost in scores.items())
            if not improved:
                stats.remove_trees_pruned += 1
                continue
            for n, d in remove_candidates(r_tree):
                if d <= shallowest:  # would leave no cut with the prefill partition
                    continue
                if not budget.take():
                    break
                child = remove(r_tree, n, d)
                stats.remove_trees_generated += 1
                if child.merkle not in seen:
                    seen.add(child.merkle)
                    queue.append((child, scores))
    if progress:
        progress("trees", len(grouped), len(grouped))
    stats.groups_early_stopped = len(stop.stopped)
    stats.bounded = group_budget.exhausted or budget.exhausted
    plans = [arranged for plan in pairs.values() for arranged in arrangements(plan, model)]
    ranked = sorted((RankedPlan(plan, sim.predict(plan.prefill, plan.decode)) for plan in plans),
                    key=lambda rp: (round(rp.prediction.latency_ms, 6), len(rp.plan.transforms)))
    stats.seconds = time.perf_counter() - start
    return SearchResult(tree=tree, plans=ranked[:top_k], stats=stats, simulator=sim)


def runnable(model: LlamaConfig, processes: int) -> bool:
    """Whether some arrangement runs ``model`` on this many processes (at most a process group's
    ``MAX_RANKS``): tensor parallel (a valid TP degree) or pipeline stages of one process each (no
    more stages than layers)."""
    return processes <= MAX_RANKS and (model.tp_degrees_ok(processes) or processes <= model.num_hidden_layers)


def arrangements(plan: SandwichPlan, model: LlamaConfig) -> list[SandwichPlan]:
    """``plan`` as tensor parallel (where its process count is a valid TP degree), its processes
    as ``pp`` pipeline stages of ``tp`` ranks each (every ``pp`` > 1 dividing them, no more stages
    than layers, ``tp`` a valid TP degree) and, on two processes, as weight-attention separation
    (the second the attention rank); the stages are consecutive processes, neighbours in the tree."""
    n = len(plan.prefill.processes)
    out = [plan] if model.tp_degrees_ok(n) else []
    for pp in range(2, n + 1):
        if n % pp == 0 and pp <= model.num_hidden_layers and model.tp_degrees_ok(n // pp):
            out.append(plan.arranged(pp=pp))
    if n == 2:  # the runtime separates one weight rank and one attention rank
        out.append(plan.arranged(wa=True))
    return out


def parse_config(tree: TopoTree, spec: str) -> ServiceConfig:
    """A configuration the user names: 'PxC' (P processes of C cores) or CPU lists.

    'PxC' cuts the tree (or one of its grouped variants) where it has P nodes and keeps
    the first C PUs of each; '0-15;16-31' lists each process's CPUs.
    """
    spec = spec.strip()
    if "x" in spec and ";" not in spec:
        try:
            procs, cores = (int(v) for v in spec.lower().split("x"))
        except ValueError as err:
            raise TopologyError(f"configuration {spec!r}: write PxC, e.g. 8x16") from err
        for candidate in explore_groups(tree, max_new_levels=1)[0]:
            where = dict(zip(candidate.pus, candidate.domains, strict=True))
            for _, config in cross_sections(candidate):
                if config.tp == procs and 1 <= cores <= config.threads:
                    kept = tuple(p[:cores] for p in config.processes)
                    doms = tuple(tuple(sorted({where[c] for c in p})) for p in kept)
                    return ServiceConfig(kept, doms)
        counts = sorted({c.tp for _, c in cross_sections(tree)})
        raise TopologyError(f"configuration {spec!r}: no cut of the tree has {procs} processes "
                            f"of at least {cores} cores (process counts: {counts})")
    from .sysfs import parse_cpulist

    try:
        procs = tuple(parse_cpulist(part) for part in spec.split(";"))
    except ValueError as err:
        raise TopologyError(f"configuration {spec!r}: {err}") from None
    unknown = sorted(set(c for p in procs for c in p) - set(tree.pus))
    if unknown or not all(procs):
        raise TopologyError(f"configuration {spec!r}: CPUs {unknown} are not in this machine")
    where = dict(zip(tree.pus, tree.domains, strict=True))
    return ServiceConfig(procs, tuple(tuple(sorted({where[c] for c in p})) for p in procs))
