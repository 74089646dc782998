"""Pipeline plans over sockets, for the cache-resident mode (``bench cache-resident``).

A machine (or a cluster modelled as one tree, a package per socket) is cut into stages of one
socket each: ``pp`` = 1 is one socket running every layer from DRAM (llama.cpp's plan on such a
machine), deeper pipelines give each socket fewer layers until its share of the weights fits its
last-level caches (cache-resident). The simulator ranks them by predicted TPOT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..model.stages import split_layers
from .configs import ServiceConfig
from .simulator import LLC_FIT, LatencySimulator
from .tree import TopoTree


@dataclass(frozen=True)
class StagePlan:
    """``pp`` stages, one socket each, the first ``pp`` sockets of the tree."""

    config: ServiceConfig
    weights: tuple[float, ...]  # bytes each stage reads per step (the head on the first)
    llc_bytes: float  # last-level cache of one socket

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def stages_resident(self) -> int:
        """Stages whose weights fit their socket's last-level caches."""
        return sum(b <= LLC_FIT * self.llc_bytes for b in self.weights)

    @property
    def resident(self) -> bool:
        """Every stage's weights fit its socket's last-level caches."""
        return self.stages_resident == self.pp

    def describe(self) -> str:
        where = "cache-resident" if self.resident else "weights from DRAM"
        return f"{self.pp} stage{'s' * (self.pp > 1)} of one socket ({where})"


def socket_plans(tree: TopoTree, sim: LatencySimulator, max_pp: int | None = None) -> list[StagePlan]:
    """Every pipeline of 1 to ``max_pp`` (default: every socket) one-socket stages."""
    depth = tree.depth_of("Package")
    sockets = tree.nodes(depth) if depth is not None else [tree.pus]
    node_of = dict(zip(tree.pus, tree.domains, strict=True))
    domains = [tuple(sorted({node_of[pu] for pu in s})) for s in sockets]
    m = sim.model
    top = min(len(sockets), m.num_hidden_layers, max_pp or len(sockets))
    plans = []
    for pp in range(1, top + 1):
        config = ServiceConfig(tuple(tuple(s) for s in sockets[:pp]), tuple(domains[:pp]), pp=pp)
        weights = tuple(sim.stage_bytes(st, 1) for st in split_layers(m.num_hidden_layers, pp))
        plans.append(StagePlan(config, weights, sim.llc_bytes(config.stage(0))))
    return plans


def tpot(plan: StagePlan, sim: LatencySimulator, context: float, batch: int = 1) -> float:
    """Predicted TPOT (ms) of ``batch`` sequences of ``context`` tokens."""
    return float(sim.tpot_ms(plan.config, np.array([float(context)]), batch=batch)[0])


def rank(plans: Sequence[StagePlan], sim: LatencySimulator, context: float, batch: int = 1
         ) -> list[tuple[StagePlan, float]]:
    """``(plan, predicted TPOT ms)`` at ``batch`` sequences of ``context`` tokens, best first."""
    scored = [(p, tpot(p, sim, context, batch)) for p in plans]
    return sorted(scored, key=lambda x: (x[1], x[0].pp))
