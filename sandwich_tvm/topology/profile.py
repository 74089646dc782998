"""Machine profiles: the roofs the latency simulator needs.

A profile is measured on the real machine (`microbench.measure_profile`, cached per CPU)
or read from a JSON file for machines we model (shipped in `profiles/`). Memory bandwidth
is a list of *resources*: each instance of a resource (a NUMA node, an L3, a latent L3-tag
cluster of 4 cores, ...) delivers ``bw_gbs[k - 1]`` GB/s when k of its cores stream at once.
A curve that falls after its peak is contention, which is what `remove` can relieve.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

PROFILE_DIR = Path(__file__).parent / "profiles"
SCOPES = ("numa", "package", "l3", "core", "latent")


class ProfileError(ValueError):
    """A machine profile that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class Resource:
    """A shared memory-path resource and its bandwidth with 1..k active cores."""

    name: str
    scope: str  # numa | package | l3 | core | latent
    bw_gbs: tuple[float, ...]
    size: int = 0  # latent: PUs per instance, consecutive in OS order ...
    stride: int = 1  # ... taken with this stride

    def bandwidth(self, active: int) -> float:
        return self.bw_gbs[min(active, len(self.bw_gbs)) - 1]


@dataclass(frozen=True)
class MachineProfile:
    """Roofs of one machine (measured or modelled)."""

    name: str
    gflops_per_core: float
    resources: tuple[Resource, ...]
    cpu_model: str = ""
    isa: str = ""
    pu_count: int = 0
    source: str = "modelled"  # "measured" for microbenchmarked profiles
    smt_gain: float = 1.15  # compute of a core running two hardware threads
    remote_factor: float = 0.6  # bandwidth fraction for remote-NUMA reads
    llc_gbs_per_core: float = 0.0  # >0: weights that fit in the LLCs stream at this rate
    gemm_efficiency: float = 0.85
    attention_efficiency: float = 0.35
    allreduce_latency_us: float = 5.0
    allreduce_cross_numa_us: float = 15.0
    allreduce_gbs: float = 20.0
    layer_overhead_us: float = 20.0
    notes: str = field(default="", compare=False)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "profile") -> MachineProfile:
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ProfileError(f"{where}: unknown fields {sorted(unknown)}")
        try:
            resources = tuple(Resource(**{**r, "bw_gbs": tuple(r["bw_gbs"])})
                              for r in raw.get("resources", ()))
            profile = cls(**{**raw, "resources": resources})
        except (TypeError, KeyError) as err:
            raise ProfileError(f"{where}: {err}") from err
        for r in profile.resources:
            if r.scope not in SCOPES or not r.bw_gbs or (r.scope == "latent" and r.size < 2):
                raise ProfileError(f"{where}: resource {r.name!r} needs a scope in {SCOPES}, "
                                   "a non-empty bw_gbs and (latent) a size >= 2")
        if profile.gflops_per_core <= 0:
            raise ProfileError(f"{where}: gflops_per_core must be positive")
        return profile


def load_profile(spec: str | Path) -> MachineProfile:
    """A shipped profile by name (see `shipped_profiles`) or a JSON file."""
    path = Path(spec)
    if not path.is_file():
        path = PROFILE_DIR / f"{spec}.json"
    if not path.is_file():
        names = ", ".join(sorted(shipped_profiles()))
        raise ProfileError(f"no machine profile {str(spec)!r}: give a JSON file or one of {names}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path} is not valid JSON: {err}") from err
    return MachineProfile.from_dict(raw, where=str(path))


def shipped_profiles() -> dict[str, MachineProfile]:
    return {p.stem: load_profile(p) for p in sorted(PROFILE_DIR.glob("*.json"))}


def match_profile(cpu_model: str, pu_count: int) -> MachineProfile | None:
    """The shipped profile whose CPU model and PU count match a modelled machine."""
    for profile in shipped_profiles().values():
        # hwloc gives ARM CPUs and synthetic machines no model string
        same_cpu = (profile.cpu_model.lower() in cpu_model.lower() if profile.cpu_model
                    else not cpu_model)
        if profile.pu_count == pu_count and same_cpu:
            return profile
    return None
