"""group/remove as the paper defines them, Merkle de-duplication, and interpretation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sandwich_tvm.topology import cross_sections, explore_groups, group, load_tree, remove
from sandwich_tvm.topology.hwobj import TopologyError
from tests.conftest import topology

FIG6 = "package:4 l3:2 [numa] group:6 core:4 pu:1"  # 4 sockets x 2 NUMA x 6 clusters x 4 cores

pytestmark = pytest.mark.hwloc


@pytest.fixture(scope="module")
def flat8():
    tree, _ = load_tree(synthetic="package:1 [numa] l3:1 core:8 pu:1")
    return tree


def test_group_with_stride(flat8):
    d = flat8.height
    assert group(flat8, 2, 1, d).nodes(d) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert group(flat8, 2, 2, d).nodes(d) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert group(flat8, 2, 4, d).nodes(d) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    four = group(flat8, 4, 1, d)
    assert four.count(d) == 2 and four.levels[d].latent and four.levels[d].arity == 2


def test_group_rejects_untileable(flat8):
    d = flat8.height
    for n, t in [(3, 1), (8, 1), (1, 1), (4, 4)]:
        with pytest.raises(TopologyError):
            group(flat8, n, t, d)


def test_remove_drops_rightmost_children_everywhere():
    tree, _ = load_tree(synthetic=FIG6)
    core_depth = tree.height
    removed = remove(tree, 1, core_depth)
    assert len(removed.pus) == 144
    assert removed.nodes(core_depth - 1)[0] == (0, 1, 2)
    assert 3 not in removed.pus and removed.removed_at == core_depth
    with pytest.raises(TopologyError):
        remove(tree, 4, core_depth)


def test_figure6_configurations():
    tree, _ = load_tree(synthetic=FIG6)
    removed = remove(tree, 1, tree.height)  # one core removed per cluster
    shapes = {config.describe(): config for _, config in cross_sections(removed)}
    assert "8x18" in shapes and "48x3" in shapes
    numa = shapes["8x18"]
    assert [d for ds in numa.domains for d in ds] == list(range(8))
    assert shapes["48x3"].domains[:6] == ((0,),) * 6 and shapes["48x3"].domains[-1] == (7,)


def test_kunpeng_hidden_clusters_are_proposed():
    hidden, _ = load_tree(xml=str(topology("kunpeng920-2s-4n-128c-noclusters")))
    visible, _ = load_tree(xml=str(topology("kunpeng920-2s-4n-128c-cluster4")))
    assert hidden.merkle != visible.merkle
    trees, _ = explore_groups(hidden, max_new_levels=1)
    match = [t for t in trees if t.merkle == visible.merkle]
    assert match and match[0].history == ("group(4,1,3)",)


def test_equivalent_trees_collapse(flat8):
    d = flat8.height
    pairs_of_pairs = group(group(flat8, 2, 1, d), 2, 1, d)  # pairs, then pairs of pairs
    quads_of_pairs = group(group(flat8, 4, 1, d), 2, 1, d + 1)  # quads, then pairs inside
    assert pairs_of_pairs.history != quads_of_pairs.history
    assert pairs_of_pairs.merkle == quads_of_pairs.merkle
    # two removes of one core equal one remove of two
    assert remove(remove(flat8, 1, d), 1, d).merkle == remove(flat8, 2, d).merkle
    trees, generated = explore_groups(flat8)
    assert len(trees) < generated
    assert len({t.merkle for t in trees}) == len(trees)


def test_merkle_ignores_sibling_order(flat8):
    d = flat8.height
    strided = group(flat8, 2, 2, d)  # (0,2) (1,3) (4,6) (5,7)
    shuffled = replace(strided, pus=(3, 1, 0, 2, 5, 7, 6, 4))  # same groups, other order
    assert shuffled.merkle == strided.merkle
    assert strided.merkle != group(flat8, 2, 1, d).merkle


def test_cross_sections_hash_away_equivalents():
    tree, _ = load_tree(xml=str(topology("epyc-milan7763-2s-2n-128c-ccx8-nosmt")))
    shapes = [config.describe() for _, config in cross_sections(tree)]
    assert shapes == ["1x128", "2x64", "16x8", "128x1"]
    assert len({c.key for _, c in cross_sections(tree)}) == len(shapes)
