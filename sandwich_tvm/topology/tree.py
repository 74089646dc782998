"""TopoTree: a symmetric tree whose leaves are PUs and whose inner levels are shared resources.

Under the paper's *symmetric and tileable* assumption every node of a level has the same
arity, so a tree is fully described by its levels (top to bottom) and its leaves in tree
order: node `i` at depth `d` owns leaves ``pus[i * span(d) : (i + 1) * span(d)]``. Levels
whose arity is 1 everywhere (an L2 private to its core, a core with one PU) are merged
into the level above, so every level is a real branching point; their hwloc names stay
in `Level.kinds`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from functools import cached_property
from math import prod

from .hwobj import MAX_PUS, Discovery, HwObject, TopologyError


@dataclass(frozen=True)
class Level:
    """One level of a TopoTree: `arity` nodes under each node of the level above."""

    kinds: tuple[str, ...]
    arity: int
    memory: bool = False  # nodes of this level own a NUMA node (a memory domain)
    cache_size: int | None = None
    latent: bool = False  # inserted by group(): a structure hwloc does not show

    @property
    def name(self) -> str:
        return "+".join(self.kinds)


@dataclass(frozen=True)
class TopoTree:
    """A symmetric TopoTree; levels[0] is the root (arity 1)."""

    levels: tuple[Level, ...]
    pus: tuple[int, ...]  # OS indexes of the leaves, in tree order
    domains: tuple[int, ...]  # the NUMA node (memory colour) of each leaf
    history: tuple[str, ...] = field(default=(), compare=False)
    removed_at: int | None = field(default=None, compare=False)  # shallowest remove depth

    @property
    def height(self) -> int:
        """Depth of the leaf level."""
        return len(self.levels) - 1

    def count(self, depth: int) -> int:
        """Number of nodes at `depth`."""
        return prod(level.arity for level in self.levels[: depth + 1])

    def span(self, depth: int) -> int:
        """Leaves under one node at `depth`."""
        return prod(level.arity for level in self.levels[depth + 1 :])

    def nodes(self, depth: int) -> list[tuple[int, ...]]:
        """The leaves (OS CPU ids) of every node at `depth`, left to right."""
        span = self.span(depth)
        return [self.pus[i : i + span] for i in range(0, len(self.pus), span)]

    def node_domains(self, depth: int) -> list[tuple[int, ...]]:
        """The NUMA nodes each node at `depth` touches."""
        span = self.span(depth)
        return [
            tuple(sorted(set(self.domains[i : i + span]))) for i in range(0, len(self.pus), span)
        ]

    def count_kind(self, kind: str) -> int:
        """How many hwloc objects of `kind` the tree holds (``NUMANode`` counts domains)."""
        if kind == "NUMANode":
            return len(set(self.domains))
        for depth, level in enumerate(self.levels):
            if kind in level.kinds:
                return self.count(depth)
        return 0

    def depth_of(self, kind: str) -> int | None:
        """Depth of the level holding hwloc objects of `kind`."""
        return next((d for d, lv in enumerate(self.levels) if kind in lv.kinds), None)

    @cached_property
    def merkle(self) -> str:
        """Merkle hash: a node hashes its memory flag and its children's sorted hashes.

        Sibling order and level names do not matter, so trees that group the same PUs the
        same way hash equal whichever transformations produced them.
        """
        digests = [hashlib.blake2b(str(pu).encode(), digest_size=16).digest() for pu in self.pus]
        for level in reversed(self.levels):
            flag = b"M" if level.memory else b"-"
            digests = [
                hashlib.blake2b(flag + b"".join(sorted(digests[i : i + level.arity])),
                                digest_size=16).digest()
                for i in range(0, len(digests), level.arity)
            ]
        return digests[0].hex()

    def summary(self) -> str:
        """One line: ``Machine:1 Package:2[NUMA] L3Cache:8 L2Cache+Core+PU:8``."""
        parts = []
        for level in self.levels:
            tag = "[NUMA]" if level.memory else ""
            tag += "*" if level.latent else ""
            parts.append(f"{level.name}:{level.arity}{tag}")
        return " ".join(parts)

    def render(self, max_nodes: int = 4) -> str:
        """A printable tree: one line per level with the CPU lists of its first nodes."""
        lines = []
        for depth, level in enumerate(self.levels):
            nodes = self.nodes(depth)
            shown = "  ".join(_clip(format_cpus(n)) for n in nodes[:max_nodes])
            more = f"  ... ({len(nodes)} in all)" if len(nodes) > max_nodes else ""
            notes = []
            if level.memory:
                notes.append("NUMA")
            if level.cache_size:
                notes.append(format_bytes(level.cache_size))
            if level.latent:
                notes.append("latent")
            note = f" ({', '.join(notes)})" if notes else ""
            lines.append(f"{'  ' * depth}{level.name} x{level.arity}{note}: {shown}{more}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    """Compact CPU list: (0, 1, 2, 3, 8) -> '0-3,8'."""
    cpus = sorted(cpus)
    runs, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            runs.append(f"{start}" if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(runs)


def _clip(text: str, width: int = 24) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def from_discovery(found: Discovery, cpus: set[int] | None = None) -> TopoTree:
    """The fundamental TopoTree of a discovered machine, optionally restricted to `cpus`.

    Raises TopologyError for machines outside the method's assumptions (several CPU kinds,
    asymmetric subtrees, unequal caches within a level), naming the fallback: restrict the
    tree to one homogeneous set of CPUs.
    """
    root = found.root
    if cpus is not None:
        have = set(root.pus())
        missing = set(cpus) - have
        if not cpus:
            raise TopologyError(f"--cpus lists no CPUs; {found.source} has CPUs {format_cpus(sorted(have))}")
        if missing:
            raise TopologyError(
                f"--cpus: CPUs {format_cpus(sorted(missing))} do not exist in {found.source}, "
                f"which has CPUs {format_cpus(sorted(have))}; list only those")
        root = root.restrict(set(cpus))
    pus = set(root.pus())
    if len(pus) > MAX_PUS:
        raise TopologyError(
            f"{found.source} has {len(pus)} PUs; sandwich-tvm plans for at most {MAX_PUS}. "
            "Plan for a part of it with --cpus, e.g. --cpus " + format_cpus(sorted(pus)[:MAX_PUS]))
    kinds = [set(kind) & pus for kind in found.cpukinds]
    kinds = [k for k in kinds if k]
    if len(kinds) > 1:
        listing = "; ".join(format_cpus(sorted(k)) for k in kinds)
        raise TopologyError(
            f"{found.source} has {len(kinds)} kinds of CPU cores ({listing}); Sandwich assumes "
            "identical cores. Restrict the tree to one kind, e.g. --cpus " + format_cpus(sorted(kinds[-1]))
        )
    return build_tree(root)


def build_tree(root: HwObject) -> TopoTree:
    """Check symmetry level by level, then merge arity-1 levels into their parents."""
    raw: list[Level] = []
    frontier = [root]
    while frontier:
        types = {obj.type for obj in frontier}
        sizes = {obj.cache_size for obj in frontier}
        numa = {len(obj.numa) for obj in frontier}
        arities = {len(obj.children) for obj in frontier}
        where = f"level {len(raw)} ({'/'.join(sorted(types))})"
        if len(types) > 1 or len(sizes) > 1 or len(numa) > 1:
            raise TopologyError(
                f"asymmetric topology at {where}: objects differ in type, cache size or NUMA "
                "attachment (hybrid or heterogeneous CPU?). Restrict to identical cores with --cpus"
            )
        if len(arities) > 1:
            raise TopologyError(
                f"asymmetric topology at {where}: nodes have {sorted(arities)} children. "
                "Restrict to a symmetric subset of CPUs with --cpus"
            )
        arity = len(frontier) // prod(level.arity for level in raw)  # root: 1 // 1
        raw.append(Level((types.pop(),), arity, memory=numa.pop() > 0, cache_size=sizes.pop()))
        frontier = [child for obj in frontier for child in obj.children]
    if raw[-1].kinds != ("PU",):
        raise TopologyError("the topology's leaves are not PUs")
    return TopoTree(levels=_merge(raw), pus=tuple(root.pus()), domains=_domains(root))


def _merge(raw: list[Level]) -> tuple[Level, ...]:
    merged = [raw[0]]
    for level in raw[1:]:
        if level.arity == 1:
            top = merged[-1]
            cache = max((c for c in (top.cache_size, level.cache_size) if c), default=None)
            merged[-1] = replace(top, kinds=top.kinds + level.kinds,
                                 memory=top.memory or level.memory, cache_size=cache)
        else:
            merged.append(level)
    return tuple(merged)


def _domains(root: HwObject) -> tuple[int, ...]:
    out: list[int] = []

    def walk(obj: HwObject, domain: int) -> None:
        domain = obj.numa[0] if obj.numa else domain
        if obj.type == "PU":
            out.append(domain)
        for child in obj.children:
            walk(child, domain)

    walk(root, 0)
    return tuple(out)
