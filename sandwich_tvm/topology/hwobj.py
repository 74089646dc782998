"""The raw object tree a discovery backend (hwloc or sysfs) hands to TopoTree.

It mirrors hwloc's vocabulary: `type` is an hwloc object type name (``Package``,
``L3Cache``, ``Group``, ``Core``, ``PU``, ...), `os_index` the OS number, and `numa` the
OS indexes of the NUMA nodes attached to the object (hwloc's memory children).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The largest tree we plan for. Real servers stay below it (8 sockets x 60 cores x 2 SMT is
# 960 PUs); hwloc needs minutes, in C code Ctrl-C cannot stop, to build synthetic machines
# of 10^5 PUs, and the search grows faster than the tree.
MAX_PUS = 2048


class TopologyError(ValueError):
    """A topology we cannot read or do not support; the message says what to do."""


@dataclass
class HwObject:
    """One hwloc object with its normal children."""

    type: str
    os_index: int | None = None
    subtype: str | None = None
    cache_size: int | None = None
    numa: tuple[int, ...] = ()
    children: list[HwObject] = field(default_factory=list)

    def pus(self) -> list[int]:
        """OS indexes of the PUs below this object, in tree order."""
        if self.type == "PU":
            return [self.os_index if self.os_index is not None else -1]
        return [pu for child in self.children for pu in child.pus()]

    def count(self, type_name: str) -> int:
        """Number of objects of `type_name` in this subtree (NUMA nodes included)."""
        own = len(self.numa) if type_name == "NUMANode" else int(self.type == type_name)
        return own + sum(child.count(type_name) for child in self.children)

    def restrict(self, cpus: set[int]) -> HwObject | None:
        """This subtree keeping only the given PUs; None when none remain."""
        if self.type == "PU":
            return self if self.os_index in cpus else None
        kept = [c for c in (child.restrict(cpus) for child in self.children) if c is not None]
        if not kept:
            return None
        return HwObject(self.type, self.os_index, self.subtype, self.cache_size, self.numa, kept)


@dataclass(frozen=True)
class Discovery:
    """What a backend found: the object tree, where it came from, and the CPU kinds."""

    root: HwObject
    source: str
    cpu_model: str = ""
    cpukinds: tuple[tuple[int, ...], ...] = ()
