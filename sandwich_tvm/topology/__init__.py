"""TopoTree: from a CPU's topology to ranked Sandwich plans (paper sections 3.3, 4, 5)."""

from __future__ import annotations

import warnings

from . import hwloc, sysfs
from .configs import SandwichPlan, ServiceConfig, cross_section, cross_sections
from .hwobj import Discovery, TopologyError
from .search import RankedPlan, SearchResult, parse_config, search_plans
from .transforms import explore_groups, group, remove
from .tree import Level, TopoTree, from_discovery

__all__ = [
    "Discovery", "Level", "RankedPlan", "SandwichPlan", "SearchResult", "ServiceConfig",
    "TopoTree", "TopologyError", "cross_section", "cross_sections", "discover", "explore_groups",
    "from_discovery", "group", "load_tree", "parse_config", "remove", "search_plans",
]


def discover(*, synthetic: str | None = None, xml: str | None = None) -> Discovery:
    """hwloc for synthetic/XML/real machines; sysfs (with a warning) when libhwloc is missing."""
    if synthetic is None and xml is None and hwloc.load_library() is None:
        warnings.warn("libhwloc 2.x not found: reading the topology from Linux sysfs "
                      "(run scripts/setup.sh as root to install libhwloc15)", stacklevel=2)
        return sysfs.discover()
    return hwloc.discover(synthetic=synthetic, xml=xml)


def load_tree(*, synthetic: str | None = None, xml: str | None = None,
              cpus: set[int] | None = None) -> tuple[TopoTree, Discovery]:
    """The fundamental TopoTree of a machine and what discovery found."""
    found = discover(synthetic=synthetic, xml=xml)
    return from_discovery(found, cpus), found
