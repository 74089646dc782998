"""The paper's two TopoTree transformations and the exhaustive exploration of `group`.

* ``group(n, t, d)`` inserts L(d)/n nodes, each grouping n >= 2 siblings at depth d taken
  with stride t: a latent structure (an L3-tag cluster, a CCX quadrant) hwloc does not show.
* ``remove(n, d)`` removes the n right-most children of every node at depth d - 1.

Both act on every node of a level at once (the symmetric and tileable assumption).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from .hwobj import TopologyError
from .tree import Level, TopoTree


def group(tree: TopoTree, n: int, t: int, d: int) -> TopoTree:
    """Group every n siblings at depth d, taken with stride t, under a new latent level."""
    if not 1 <= d <= tree.height:
        raise TopologyError(f"group: depth {d} is outside 1..{tree.height}")
    a = tree.levels[d].arity
    if n < 2 or n >= a or t < 1 or a % (n * t):
        raise TopologyError(f"group({n}, {t}, {d}): {a} siblings cannot be tiled into groups "
                            f"of {n} with stride {t}")
    order = []  # new sibling order: group after group
    for g in range(a // n):
        block, r = divmod(g, t)
        order.extend(block * n * t + r + k * t for k in range(n))
    perm = [p * a + j for p in range(tree.count(d - 1)) for j in order]
    span = tree.span(d)
    pus, domains = [], []
    for child in perm:
        pus.extend(tree.pus[child * span : (child + 1) * span])
        domains.extend(tree.domains[child * span : (child + 1) * span])
    new_level = Level(("Group",), a // n, latent=True)
    levels = tree.levels[:d] + (new_level, replace(tree.levels[d], arity=n)) + tree.levels[d + 1 :]
    return TopoTree(levels, tuple(pus), tuple(domains),
                    history=tree.history + (f"group({n},{t},{d})",))


def remove(tree: TopoTree, n: int, d: int) -> TopoTree:
    """Remove the n right-most children of every node at depth d - 1."""
    if not 1 <= d <= tree.height:
        raise TopologyError(f"remove: depth {d} is outside 1..{tree.height}")
    a = tree.levels[d].arity
    if not 1 <= n < a:
        raise TopologyError(f"remove({n}, {d}): nodes at depth {d - 1} have only {a} children")
    span, keep = tree.span(d), (a - n) * tree.span(d)
    parent = a * span
    idx = [i for start in range(0, len(tree.pus), parent) for i in range(start, start + keep)]
    levels = tree.levels[:d] + (replace(tree.levels[d], arity=a - n),) + tree.levels[d + 1 :]
    removed_at = d if tree.removed_at is None else min(d, tree.removed_at)
    return TopoTree(levels, tuple(tree.pus[i] for i in idx), tuple(tree.domains[i] for i in idx),
                    history=tree.history + (f"remove({n},{d})",), removed_at=removed_at)


def group_candidates(tree: TopoTree, power_of_two: bool = True) -> Iterator[tuple[int, int, int]]:
    """Every valid (n, t, d) for `group`; A.3 (n a power of two) unless disabled."""
    for d in range(1, tree.height + 1):
        a = tree.levels[d].arity
        for n in range(2, a):
            if a % n or (power_of_two and n & (n - 1)):
                continue
            for t in range(1, a // n + 1):
                if a % (n * t) == 0:
                    yield n, t, d


def remove_candidates(tree: TopoTree) -> Iterator[tuple[int, int]]:
    """Every valid (n, d) for `remove`."""
    for d in range(1, tree.height + 1):
        for n in range(1, tree.levels[d].arity):
            yield n, d


@dataclass
class TreeBudget:
    """How many more TopoTrees group()/remove() may generate (None: no bound)."""

    left: int | None = None
    exhausted: bool = False  # a tree was refused: the exploration is incomplete

    def take(self) -> bool:
        """Spend one tree; False (and `exhausted`) once the budget is spent."""
        if self.left is None:
            return True
        if self.left <= 0:
            self.exhausted = True
            return False
        self.left -= 1
        return True


def explore_groups(tree: TopoTree, *, max_new_levels: int = 2, power_of_two: bool = True,
                   budget: TreeBudget | None = None) -> tuple[list[TopoTree], int]:
    """All trees reachable by up to `max_new_levels` groups, de-duplicated by Merkle hash.

    Returns the unique trees (the fundamental one first) and how many were generated.
    Group order is inconsequential, so equal trees reached by different orders collapse.
    With a `budget`, generation stops when it is spent (see `budget.exhausted`).
    """
    budget = budget or TreeBudget()
    unique = {tree.merkle: tree}
    frontier, generated = [tree], 1
    for _ in range(max_new_levels):
        nxt = []
        for parent in frontier:
            for n, t, d in group_candidates(parent, power_of_two):
                if not budget.take():
                    return list(unique.values()), generated
                child = group(parent, n, t, d)
                generated += 1
                if child.merkle not in unique:
                    unique[child.merkle] = child
                    nxt.append(child)
        frontier = nxt
    return list(unique.values()), generated
