"""Fallback discovery from Linux sysfs, for machines without libhwloc.

It sees what the kernel exports: packages, cores and SMT siblings, L2/L3 sharing and the
NUMA nodes' CPU lists. Each NUMA node is attached to the smallest object with the same CPU
set (as hwloc does) or, failing that, to the machine.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

from .hwobj import Discovery, HwObject, TopologyError

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")
_CPU_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)
MAX_CPU_ID = 65535  # far above any Linux build (NR_CPUS is at most 8192)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); ValueError naming the part it cannot read."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        where = f"{part!r}" + ("" if part == text.strip() else f" in CPU list {text!r}")
        match = _CPU_RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"{where} is not a CPU id or a range LOW-HIGH; write e.g. 0-11,16")
        first = int(match[1])
        last = int(match[2]) if match[2] else first
        if last < first:
            raise ValueError(f"{where} is a reversed range; write {last}-{first}")
        if last > MAX_CPU_ID:
            raise ValueError(f"{where}: CPU id {last} is past {MAX_CPU_ID}, the largest we accept")
        cpus.extend(range(first, last + 1))
    return tuple(cpus)


def _read(path: Path) -> str:
    return path.read_text().strip()


def _caches(cpu_dir: Path) -> dict[int, tuple[tuple[int, ...], int]]:
    """Unified/data cache level -> (sharing CPUs, size in bytes)."""
    out = {}
    for index in sorted((cpu_dir / "cache").glob("index*")):
        if _read(index / "type") == "Instruction":
            continue
        size = _read(index / "size")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        nbytes = int(size.rstrip("KMG")) * scale
        out[int(_read(index / "level"))] = (parse_cpulist(_read(index / "shared_cpu_list")), nbytes)
    return out


def discover(root: Path = SYS_CPU, nodes: Path = SYS_NODE) -> Discovery:
    """Read the running machine's topology from sysfs."""
    cpus = parse_cpulist(_read(root / "online")) if (root / "online").exists() else ()
    if not cpus:
        raise TopologyError(f"no online CPUs listed under {root}; is /sys mounted?")
    machine = HwObject("Machine", 0)
    index: dict[tuple, HwObject] = {}
    for cpu in cpus:
        topo = root / f"cpu{cpu}" / "topology"
        package = int(_read(topo / "physical_package_id"))
        caches = _caches(root / f"cpu{cpu}")
        path = [("Package", package, None)]
        for level in (3, 2):
            if level in caches:
                shared, size = caches[level]
                path.append((f"L{level}Cache", min(shared), size))
        path.append(("Core", int(_read(topo / "core_id")), None))
        parent, key = machine, ()
        for type_name, os_index, size in path:
            key += ((type_name, os_index),)
            if key not in index:
                index[key] = HwObject(type_name, os_index, cache_size=size)
                parent.children.append(index[key])
            parent = index[key]
        parent.children.append(HwObject("PU", cpu))
    _attach_numa(machine, nodes)
    return Discovery(root=machine, source="sysfs:this-machine", cpu_model=platform.processor())


def _attach_numa(machine: HwObject, nodes: Path) -> None:
    node_dirs = sorted(nodes.glob("node[0-9]*")) if nodes.exists() else []
    if not node_dirs:
        machine.numa = (0,)
        return
    for node_dir in node_dirs:
        node_cpus = set(parse_cpulist(_read(node_dir / "cpulist")))
        if not node_cpus:
            continue  # a memory-only node (CXL, HBM): no CPUs to colour
        target = _smallest_with(machine, node_cpus) or machine
        target.numa += (int(node_dir.name[4:]),)


def _smallest_with(obj: HwObject, cpus: set[int]) -> HwObject | None:
    for child in obj.children:
        found = _smallest_with(child, cpus)
        if found is not None:
            return found
    return obj if obj.type != "PU" and set(obj.pus()) == cpus else None
