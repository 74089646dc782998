"""Interpretation: horizontal cross-sections of a TopoTree become service configurations.

Cutting a tree at depth c makes every node at that depth one process; its leaves are the
process's cores and the NUMA nodes they sit in are its memory domains. The processes are one
tensor-parallel group, or pipeline stages of ``tp`` each (``pp``), or weight ranks beside an
attention rank (``wa``). A Sandwich plan pairs two configurations over one
partition: prefill on every core of each process, decode on the cores a `remove` kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .tree import TopoTree, format_cpus


@dataclass(frozen=True)
class ServiceConfig:
    """Processes (OS CPU ids each) and the NUMA nodes each process uses; with ``pp`` > 1 they
    are pipeline stages of ``tp`` processes each, in order; with ``wa`` the last process holds
    the KV cache and attends (weight-attention separation)."""

    processes: tuple[tuple[int, ...], ...]
    domains: tuple[tuple[int, ...], ...]
    pp: int = 1
    hosts: bool = False  # stages 1.. on other hosts: every exchange relayed over the network
    wa: bool = False

    @property
    def tp(self) -> int:
        return (len(self.processes) - self.wa) // self.pp

    def side(self, i: int) -> ServiceConfig:
        """A separated configuration's weight side (0) or attention side (1), alone."""
        part = slice(0, self.tp) if i == 0 else slice(self.tp, self.tp + 1)
        return ServiceConfig(self.processes[part], self.domains[part])

    def stage(self, i: int) -> ServiceConfig:
        """Pipeline stage ``i``'s processes as a configuration of their own."""
        part = slice(i * self.tp, (i + 1) * self.tp)
        return ServiceConfig(self.processes[part], self.domains[part])

    @property
    def threads(self) -> int:
        """Threads per process (one per PU)."""
        return len(self.processes[0])

    @property
    def key(self) -> tuple[tuple[int, ...], ...]:
        """Canonical form: equal for configurations that use the same CPU sets."""
        return tuple(sorted(tuple(sorted(p)) for p in self.processes))

    @property
    def group_key(self) -> tuple:
        """Process count and memory domains: the unit of early stopping."""
        return (self.tp, tuple(sorted(self.domains)))

    def cpus(self) -> list[int]:
        return sorted(c for p in self.processes for c in p)

    def describe(self) -> str:
        where = " on hosts" if self.hosts else ""
        return (f"{self.tp}x{self.threads}" + (f" x{self.pp} stages{where}" if self.pp > 1 else "")
                + (" + attention rank" if self.wa else ""))

    def to_dict(self) -> dict:
        return {"processes": len(self.processes), "tp": self.tp, "pp": self.pp, "wa": self.wa,
                "threads": self.threads,
                "cpus": [list(p) for p in self.processes],
                "numa": [list(d) for d in self.domains]}

    def __str__(self) -> str:
        shown = "; ".join(format_cpus(p) for p in self.processes[:4])
        more = " ..." if len(self.processes) > 4 else ""
        return f"{self.describe()} [{shown}{more}]"


def cross_section(tree: TopoTree, depth: int) -> ServiceConfig:
    """The configuration that cuts `tree` at `depth`."""
    return ServiceConfig(tuple(tree.nodes(depth)), tuple(tree.node_domains(depth)))


def cross_sections(tree: TopoTree) -> list[tuple[int, ServiceConfig]]:
    """Every (depth, configuration) from the root down, equivalent ones hashed away."""
    out, seen = [], set()
    for depth in range(tree.height + 1):
        config = cross_section(tree, depth)
        if config.key not in seen:
            seen.add(config.key)
            out.append((depth, config))
    return out


@dataclass(frozen=True)
class SandwichPlan:
    """One model partition; prefill on all of each process's cores, decode on a subset."""

    prefill: ServiceConfig
    decode: ServiceConfig
    transforms: tuple[str, ...] = ()

    @property
    def tp(self) -> int:
        return self.prefill.tp

    def arranged(self, pp: int = 1, wa: bool = False) -> SandwichPlan:
        """The same processes and cores as ``pp`` pipeline stages, or with the last process the
        attention rank (``wa``), instead of one tensor-parallel group."""
        how = f"pp{pp}" if pp > 1 else "wa" if wa else ""
        return SandwichPlan(replace(self.prefill, pp=pp, wa=wa), replace(self.decode, pp=pp, wa=wa),
                            self.transforms + ((how,) if how else ()))

    def to_dict(self) -> dict:
        return {
            "processes": len(self.prefill.processes),
            "tp": self.tp,
            "pp": self.prefill.pp,
            "wa": self.prefill.wa,
            "prefill_threads": self.prefill.threads,
            "decode_threads": self.decode.threads,
            "prefill_cpus": [list(p) for p in self.prefill.processes],
            "decode_cpus": [list(p) for p in self.decode.processes],
            "numa": [list(d) for d in self.prefill.domains],
            "transforms": list(self.transforms),
        }
