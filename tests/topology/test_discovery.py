"""Discovery: hwloc (real, synthetic, XML), the sysfs fallback, and unsupported machines."""

from __future__ import annotations

import os

import pytest

from sandwich_tvm.topology import hwloc, load_tree, sysfs
from sandwich_tvm.topology.hwobj import TopologyError
from sandwich_tvm.topology.tree import from_discovery
from tests.conftest import KUNPENG_192, TOPOLOGIES, topology

SYMMETRIC = ["epyc-milan7763-2s-2n-128c-ccx8-nosmt", "kunpeng920-2s-4n-128c-cluster4",
             "kunpeng920-2s-4n-128c-noclusters", "laptop-i7-7600u-1s-2c-ht",
             "xeon-gold6230-2s-1n-40c-ht-cpuid", "xeon-gold6230-2s-4n-snc2-2lm",
             "xeon-silver4108-2s-2n-16c-ht"]


@pytest.mark.hwloc
@pytest.mark.parametrize("name", SYMMETRIC)
def test_fundamental_tree_matches_hwloc_counts(name):
    found = hwloc.discover(xml=topology(name))
    tree = from_discovery(found)
    for kind in ("Package", "NUMANode", "L3Cache", "Core", "PU"):
        assert tree.count_kind(kind) == found.root.count(kind), kind
    assert sorted(tree.pus) == sorted(found.root.pus())
    assert len(tree.pus) == tree.count(tree.height)


@pytest.mark.hwloc
def test_known_counts_of_fixtures():
    milan, _ = load_tree(xml=str(topology("epyc-milan7763-2s-2n-128c-ccx8-nosmt")))
    assert (milan.count_kind("Package"), milan.count_kind("NUMANode"),
            milan.count_kind("L3Cache"), len(milan.pus)) == (2, 2, 16, 128)
    assert milan.nodes(milan.depth_of("L3Cache"))[1] == tuple(range(8, 16))
    kunpeng, _ = load_tree(xml=str(topology("kunpeng920-2s-4n-128c-cluster4")))
    assert kunpeng.count_kind("Group") == 32 and kunpeng.count_kind("NUMANode") == 4
    assert kunpeng.levels[kunpeng.depth_of("L3Cache")].memory  # NUMA hangs under the L3


@pytest.mark.hwloc
def test_synthetic_kunpeng_192():
    tree, found = load_tree(synthetic=KUNPENG_192)
    assert found.source.startswith("synthetic:")
    assert (tree.count_kind("Package"), tree.count_kind("NUMANode"), len(tree.pus)) == (4, 8, 192)
    assert tree.node_domains(2)[3] == (3,)


@pytest.mark.hwloc
def test_smt_siblings_share_a_core():
    tree, _ = load_tree(xml=str(topology("laptop-i7-7600u-1s-2c-ht")))
    core_depth = tree.depth_of("Core")
    assert tree.nodes(core_depth) == [(0, 2), (1, 3)]  # HT sibling of P#i is P#i+2


@pytest.mark.hwloc
@pytest.mark.parametrize("name", ["hybrid-raptorlake-i7-1370p-6p8e", "hybrid-arm-gb10-10x925-10a725"])
def test_hybrid_cpus_get_a_clear_error(name):
    with pytest.raises(TopologyError, match="--cpus"):
        load_tree(xml=str(topology(name)))


@pytest.mark.hwloc
def test_hybrid_restricted_to_p_cores_is_symmetric():
    tree, _ = load_tree(xml=str(topology("hybrid-raptorlake-i7-1370p-6p8e")), cpus=set(range(12)))
    assert len(tree.pus) == 12 and tree.count_kind("Core") == 6


@pytest.mark.hwloc
@pytest.mark.parametrize("bad", ["package:2 core:x pu:1", "banana:3", "package:2 core:4 pu:1 ]"])
def test_malformed_synthetic_is_rejected(bad):
    with pytest.raises(TopologyError, match="synthetic"):
        load_tree(synthetic=bad)


@pytest.mark.hwloc
def test_missing_and_corrupt_xml(tmp_path):
    with pytest.raises(TopologyError, match="does not exist"):
        load_tree(xml=str(tmp_path / "nope.xml"))
    broken = tmp_path / "broken.xml"
    broken.write_text((TOPOLOGIES / "laptop-i7-7600u-1s-2c-ht.xml").read_text()[:500])
    with pytest.raises(TopologyError, match="could not parse"):
        load_tree(xml=str(broken))


@pytest.mark.hwloc
def test_real_machine_tree_covers_our_cpus():
    tree, found = load_tree()
    assert set(os.sched_getaffinity(0)) <= set(tree.pus)
    assert found.source == "hwloc:this-machine"


def _fake_sysfs(root, packages=2, cores=2, smt=2):
    cpu_dir, node_dir = root / "cpu", root / "node"
    n = packages * cores * smt
    (cpu_dir).mkdir(parents=True)
    (cpu_dir / "online").write_text(f"0-{n - 1}\n")
    for cpu in range(n):
        pkg, rest = divmod(cpu, cores * smt)
        core = rest // smt
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{pkg}\n")
        (topo / "core_id").write_text(f"{core}\n")
        for idx, (level, shared, size) in enumerate([
                (2, f"{cpu - cpu % smt}-{cpu - cpu % smt + smt - 1}", "1024K"),
                (3, f"{pkg * cores * smt}-{(pkg + 1) * cores * smt - 1}", "32M")]):
            cache = cpu_dir / f"cpu{cpu}" / "cache" / f"index{idx}"
            cache.mkdir(parents=True)
            for fname, value in (("type", "Unified"), ("level", level),
                                 ("shared_cpu_list", shared), ("size", size)):
                (cache / fname).write_text(f"{value}\n")
    for pkg in range(packages):
        (node_dir / f"node{pkg}").mkdir(parents=True)
        (node_dir / f"node{pkg}" / "cpulist").write_text(
            f"{pkg * cores * smt}-{(pkg + 1) * cores * smt - 1}\n")
    return cpu_dir, node_dir


def test_sysfs_fallback_builds_the_same_shape(tmp_path):
    cpu_dir, node_dir = _fake_sysfs(tmp_path)
    found = sysfs.discover(cpu_dir, node_dir)
    tree = from_discovery(found)
    assert tree.count_kind("Package") == 2 and tree.count_kind("NUMANode") == 2
    assert tree.count_kind("Core") == 4 and len(tree.pus) == 8
    assert tree.nodes(tree.depth_of("Core"))[0] == (0, 1)
    assert tree.levels[tree.depth_of("Package")].memory


def test_sysfs_parse_cpulist():
    assert sysfs.parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)


def test_real_machine_falls_back_to_sysfs_with_a_warning(monkeypatch):
    from sandwich_tvm import topology

    monkeypatch.setattr(topology.hwloc, "load_library", lambda: None)
    with pytest.warns(UserWarning, match="sysfs"):
        tree, found = topology.load_tree()
    assert found.source == "sysfs:this-machine"
    assert set(os.sched_getaffinity(0)) <= set(tree.pus)
    with pytest.raises(TopologyError, match="libhwloc"):
        topology.hwloc.discover(synthetic="package:1 core:2 pu:1")


def test_a_thread_binds_its_memory_to_a_numa_node():
    """What a rank does before loading its shard on a multi-node plan (hwloc's strict BIND)."""
    import threading

    if hwloc.load_library() is None:
        pytest.skip("libhwloc 2.x is not installed")
    result: dict = {}

    def bind() -> None:
        result["bound"] = hwloc.bind_memory([0])
        result["read"] = hwloc.memory_binding()
        try:
            hwloc.bind_memory([4095])  # no such node
        except hwloc.MembindError as err:
            result["error"] = str(err)

    thread = threading.Thread(target=bind)
    thread.start()
    thread.join()
    assert result["bound"] == result["read"] == [0]
    assert "could not bind memory to NUMA nodes [4095]" in result["error"]
    assert hwloc.numa_node_count() >= 1
