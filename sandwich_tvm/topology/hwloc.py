"""ctypes bindings to Debian's libhwloc 2.x: the real machine, a synthetic string, or XML.

Only the handful of exported functions we need are bound. `struct hwloc_obj` is declared
field by field in the 2.x order; the `static inline` helpers of hwloc.h are not exported,
so the tree is walked from `hwloc_get_obj_by_depth(topo, 0, 0)`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import re
from pathlib import Path

from .hwobj import MAX_PUS, Discovery, HwObject, TopologyError

# Types that are shared resources worth a tree level. L1 caches, memory-side caches,
# I/O and Misc objects are dropped; NUMA nodes become colours of their parent.
KEPT_TYPES = ("Machine", "Package", "Die", "Group", "L4Cache", "L3Cache", "L2Cache", "Core", "PU")


class _Info(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


class _Obj(ctypes.Structure):
    pass


_ObjP = ctypes.POINTER(_Obj)
_Obj._fields_ = [
    ("type", ctypes.c_int),
    ("subtype", ctypes.c_char_p),
    ("os_index", ctypes.c_uint),
    ("name", ctypes.c_char_p),
    ("total_memory", ctypes.c_uint64),
    ("attr", ctypes.POINTER(ctypes.c_uint64)),  # union; caches and NUMA start with a size
    ("depth", ctypes.c_int),
    ("logical_index", ctypes.c_uint),
    ("next_cousin", _ObjP),
    ("prev_cousin", _ObjP),
    ("parent", _ObjP),
    ("sibling_rank", ctypes.c_uint),
    ("next_sibling", _ObjP),
    ("prev_sibling", _ObjP),
    ("arity", ctypes.c_uint),
    ("children", ctypes.POINTER(_ObjP)),
    ("first_child", _ObjP),
    ("last_child", _ObjP),
    ("symmetric_subtree", ctypes.c_int),
    ("memory_arity", ctypes.c_uint),
    ("memory_first_child", _ObjP),
    ("io_arity", ctypes.c_uint),
    ("io_first_child", _ObjP),
    ("misc_arity", ctypes.c_uint),
    ("misc_first_child", _ObjP),
    ("cpuset", ctypes.c_void_p),
    ("complete_cpuset", ctypes.c_void_p),
    ("nodeset", ctypes.c_void_p),
    ("complete_nodeset", ctypes.c_void_p),
    ("infos", ctypes.POINTER(_Info)),
    ("infos_count", ctypes.c_uint),
    ("userdata", ctypes.c_void_p),
    ("gp_index", ctypes.c_uint64),
]

_NO_INDEX = 0xFFFFFFFF


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """libhwloc 2.x, or None when it is not installed (callers fall back to sysfs)."""
    for name in ("libhwloc.so.15", ctypes.util.find_library("hwloc")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        lib.hwloc_get_api_version.restype = ctypes.c_uint
        if lib.hwloc_get_api_version() >> 16 != 2:
            continue
        _declare(lib)
        return lib
    return None


def _declare(lib: ctypes.CDLL) -> None:
    vp = ctypes.c_void_p
    lib.hwloc_topology_init.argtypes = [ctypes.POINTER(vp)]
    lib.hwloc_topology_set_synthetic.argtypes = [vp, ctypes.c_char_p]
    lib.hwloc_topology_set_xml.argtypes = [vp, ctypes.c_char_p]
    lib.hwloc_topology_load.argtypes = [vp]
    lib.hwloc_topology_destroy.argtypes = [vp]
    lib.hwloc_get_obj_by_depth.argtypes = [vp, ctypes.c_int, ctypes.c_uint]
    lib.hwloc_get_obj_by_depth.restype = _ObjP
    lib.hwloc_obj_type_string.argtypes = [ctypes.c_int]
    lib.hwloc_obj_type_string.restype = ctypes.c_char_p
    lib.hwloc_cpukinds_get_nr.argtypes = [vp, ctypes.c_ulong]
    lib.hwloc_cpukinds_get_info.argtypes = [
        vp, ctypes.c_uint, vp, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.POINTER(_Info)), ctypes.c_ulong,
    ]
    lib.hwloc_bitmap_alloc.restype = vp
    lib.hwloc_bitmap_free.argtypes = [vp]
    lib.hwloc_bitmap_next.argtypes = [vp, ctypes.c_int]
    lib.hwloc_bitmap_set.argtypes = [vp, ctypes.c_uint]
    lib.hwloc_set_membind.argtypes = [vp, vp, ctypes.c_int, ctypes.c_int]
    lib.hwloc_get_membind.argtypes = [vp, vp, ctypes.POINTER(ctypes.c_int), ctypes.c_int]


MEMBIND_BIND = 2  # hwloc_membind_policy_t: allocate on these nodes
MEMBIND_THREAD, MEMBIND_STRICT, MEMBIND_BYNODESET = 1 << 1, 1 << 2, 1 << 5


class MembindError(RuntimeError):
    """Memory cannot be bound to the NUMA nodes a plan names; the message says why."""


def numa_node_count() -> int:
    """NUMA nodes of this machine (sysfs; 1 where it says nothing)."""
    return max(1, len([p for p in Path("/sys/devices/system/node").glob("node[0-9]*")]))


def _membind(nodes: list[int] | None) -> list[int]:
    """Bind the calling thread's future allocations to ``nodes`` (None: only read the binding);
    returns the nodes bound afterwards."""
    lib = load_library()
    if lib is None:
        raise MembindError("binding memory to NUMA nodes needs libhwloc 2.x (apt install libhwloc15)")
    topo = ctypes.c_void_p()
    lib.hwloc_topology_init(ctypes.byref(topo))
    bitmap = lib.hwloc_bitmap_alloc()
    try:
        lib.hwloc_topology_load(topo)
        if nodes is not None:
            for node in nodes:
                lib.hwloc_bitmap_set(bitmap, node)
            flags = MEMBIND_THREAD | MEMBIND_STRICT | MEMBIND_BYNODESET
            if lib.hwloc_set_membind(topo, bitmap, MEMBIND_BIND, flags) != 0:
                raise MembindError(f"hwloc could not bind memory to NUMA nodes {nodes}: "
                                   f"{os.strerror(ctypes.get_errno())}")
        policy = ctypes.c_int()
        # read back into the same bitmap (hwloc_get_membind overwrites it)
        if lib.hwloc_get_membind(topo, bitmap, ctypes.byref(policy), MEMBIND_THREAD | MEMBIND_BYNODESET) != 0:
            raise MembindError(f"hwloc cannot read the memory binding: {os.strerror(ctypes.get_errno())}")
        out, i = [], lib.hwloc_bitmap_next(bitmap, -1)
        while i >= 0:
            out.append(i)
            i = lib.hwloc_bitmap_next(bitmap, i)
        return out
    finally:
        lib.hwloc_bitmap_free(bitmap)
        lib.hwloc_topology_destroy(topo)


def bind_memory(nodes: list[int]) -> list[int]:
    """Allocate the calling thread's future memory on NUMA ``nodes`` (hwloc's strict BIND
    policy), as a rank does before it first touches its weights; returns the bound nodes."""
    return _membind(list(nodes))


def memory_binding() -> list[int]:
    """The NUMA nodes the calling thread's allocations go to."""
    return _membind(None)


def discover(*, synthetic: str | None = None, xml: str | os.PathLike | None = None) -> Discovery:
    """Load a topology through hwloc: synthetic string, XML file, or (neither) this machine."""
    if synthetic is not None:
        check_synthetic_size(synthetic)
    lib = load_library()
    if lib is None:
        raise TopologyError(
            "libhwloc 2.x is not installed: run `bash scripts/setup.sh` (as root it installs "
            "Debian's libhwloc15), or use the real machine, which falls back to Linux sysfs"
        )
    topo = ctypes.c_void_p()
    if lib.hwloc_topology_init(ctypes.byref(topo)) != 0:
        raise TopologyError("hwloc_topology_init failed")
    try:
        source = _configure(lib, topo, synthetic, xml)
        if lib.hwloc_topology_load(topo) != 0:
            hint = (" (could not parse it: malformed or truncated XML; export a fresh one with "
                    "`lstopo-no-graphics --of xml > machine.xml`)" if xml is not None else "")
            raise TopologyError(f"hwloc could not load {source}{hint}")
        root = lib.hwloc_get_obj_by_depth(topo, 0, 0)
        return Discovery(
            root=_convert(lib, root.contents),
            source=source,
            cpu_model=_cpu_model(root.contents),
            cpukinds=_cpukinds(lib, topo),
        )
    finally:
        lib.hwloc_topology_destroy(topo)


def _configure(lib: ctypes.CDLL, topo: ctypes.c_void_p, synthetic: str | None, xml) -> str:
    if synthetic is not None:
        if lib.hwloc_topology_set_synthetic(topo, synthetic.encode()) != 0:
            raise TopologyError(
                f"hwloc rejected the synthetic description {synthetic!r}. Write levels as "
                "`type:count` from the top, e.g. 'package:2 [numa] l3:4 core:8 pu:1' "
                "(see `man hwloc-synthetic` or lstopo --of synthetic)"
            )
        return f"synthetic:{synthetic}"
    if xml is not None:
        path = Path(xml)
        export = "export one with `lstopo-no-graphics --of xml > machine.xml`"
        if path.is_dir():
            raise TopologyError(f"--xml {str(path)!r} is a directory, not an XML file; pass the "
                                f"topology file itself ({export})")
        if not path.is_file():
            raise TopologyError(f"topology XML file {str(path)!r} does not exist; {export}")
        if not os.access(path, os.R_OK):
            raise TopologyError(f"topology XML file {str(path)!r} cannot be read (permission denied)")
        if lib.hwloc_topology_set_xml(topo, str(path).encode()) != 0:
            raise TopologyError(f"hwloc could not parse the XML file {str(path)!r}; {export}")
        return f"xml:{path.name}"
    return "hwloc:this-machine"


def synthetic_pus(synthetic: str) -> int | None:
    """PUs a synthetic description asks for: the product of its level counts.

    Memory levels (``[numa]``) and attributes (``(size=24MiB)``) add none. None when a
    level does not read as ``type:count`` (hwloc then judges the string).
    """
    bare = re.sub(r"\[[^\]]*\]|\([^)]*\)", " ", synthetic)
    counts = []
    for level in bare.split():
        count = level.rpartition(":")[2]
        if not count.isascii() or not count.isdigit():
            return None
        counts.append(int(count))
    return math.prod(counts) if counts else None


def check_synthetic_size(synthetic: str) -> None:
    """Refuse, before hwloc builds it, a synthetic machine larger than MAX_PUS."""
    pus = synthetic_pus(synthetic)
    if pus is not None and pus > MAX_PUS:
        raise TopologyError(
            f"the synthetic description {synthetic!r} has {pus} PUs; sandwich-tvm plans for at "
            f"most {MAX_PUS} PUs (hwloc alone would take minutes to build it). Describe a "
            "smaller machine, e.g. 'package:2 [numa] l3:8 core:8 pu:2'"
        )


def _convert(lib: ctypes.CDLL, obj: _Obj) -> HwObject:
    type_name = lib.hwloc_obj_type_string(obj.type).decode()
    numa, child = [], obj.memory_first_child
    while child:
        numa.extend(_numa_indexes(lib, child.contents))
        child = child.contents.next_sibling
    cache = obj.attr.contents.value if type_name.endswith("Cache") and obj.attr else None
    node = HwObject(
        type=type_name,
        os_index=None if obj.os_index == _NO_INDEX else obj.os_index,
        subtype=obj.subtype.decode() if obj.subtype else None,
        cache_size=cache,
        numa=tuple(numa),
    )
    for i in range(obj.arity):
        sub = _convert(lib, obj.children[i].contents)
        if sub.type in KEPT_TYPES:
            node.children.append(sub)
        else:  # an L1 cache or a memory-side cache: splice its children in
            node.children.extend(sub.children)
            node.numa += sub.numa
    return node


def _numa_indexes(lib: ctypes.CDLL, obj: _Obj) -> list[int]:
    """NUMA nodes below a memory child (memory-side caches sit above them)."""
    if lib.hwloc_obj_type_string(obj.type).decode() == "NUMANode":
        return [obj.os_index]
    out, child = [], obj.memory_first_child
    while child:
        out.extend(_numa_indexes(lib, child.contents))
        child = child.contents.next_sibling
    return out


def _cpu_model(root: _Obj) -> str:
    """The CPUModel info hwloc puts on Package (x86) or on the root."""
    stack = [root]
    while stack:
        obj = stack.pop()
        for i in range(obj.infos_count):
            if obj.infos[i].name == b"CPUModel" and obj.infos[i].value:
                return obj.infos[i].value.decode().strip()
        stack.extend(obj.children[i].contents for i in range(obj.arity))
    return ""


def _cpukinds(lib: ctypes.CDLL, topo: ctypes.c_void_p) -> tuple[tuple[int, ...], ...]:
    kinds = []
    for k in range(max(lib.hwloc_cpukinds_get_nr(topo, 0), 0)):
        bitmap = lib.hwloc_bitmap_alloc()
        try:
            lib.hwloc_cpukinds_get_info(topo, k, bitmap, None, None, None, 0)
            cpus, cpu = [], lib.hwloc_bitmap_next(bitmap, -1)
            while cpu >= 0:
                cpus.append(cpu)
                cpu = lib.hwloc_bitmap_next(bitmap, cpu)
            kinds.append(tuple(cpus))
        finally:
            lib.hwloc_bitmap_free(bitmap)
    return tuple(kinds)
