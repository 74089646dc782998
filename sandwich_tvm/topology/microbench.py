"""Short microbenchmarks that turn this machine into a MachineProfile (cached per CPU).

* compute: the fp32 FMA peak of one core (a register-only loop of the ISA's widest vectors,
  ``kernels.peak``), the roof the modelled profiles state as cores x FMA pipes x lanes x 2 x
  GHz; the simulator takes ``gemm_efficiency`` of it. (OpenBLAS's SGEMM was the roof before: on
  a Zen 5 it reached half the AVX-512 FMA peak, and the bf16 kernels, at 0.84 of twice the
  peak, beat the simulator's prefill by 1.9x.)
* memory: a TVM-compiled streaming read of a 1 GiB buffer with 1..n threads pinned to the
  cores of one NUMA node, giving that node's bandwidth curve; the same read of half the
  last-level cache, read again and again (so it stays there), gives the LLC roof per core;
* attention: Sandwich's prefill attention kernel on one core, as a fraction of that roof.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable

import numpy as np

from ..host import cache_dir, cold_weight_bytes, last_level_cache_bytes, save_atomic
from .profile import MachineProfile, Resource
from .tree import TopoTree

PROFILE_VERSION = 5  # bump when a measurement changes, so cached profiles are re-measured


def sgemm_gflops(cpu: int, n: int = 1536, repeats: int = 5) -> float:
    """Median single-core SGEMM GFLOPS on `cpu` (numpy/OpenBLAS, one thread)."""
    from threadpoolctl import threadpool_limits

    before = os.sched_getaffinity(0)
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    try:
        os.sched_setaffinity(0, {cpu})
        with threadpool_limits(1):
            a @ b
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, before)
    return 2 * n**3 / float(np.median(times)) / 1e9


def _read_kernel(rows: int, k: int):
    from ..tvm_compat import T

    @T.prim_func
    def read_sum(a: T.Buffer((rows, k, 4, 8), "float32"), out: T.Buffer((rows, 4, 8), "float32")):
        for r in T.parallel(rows):
            for j in T.unroll(4):
                for lane in T.vectorized(8):
                    out[r, j, lane] = T.float32(0)
            for kk in range(k):
                for j in T.unroll(4):
                    for lane in T.vectorized(8):
                        out[r, j, lane] = out[r, j, lane] + a[r, kk, j, lane]

    return read_sum


def read_bandwidth(cpus: list[int], nbytes: int | None = None, repeats: int = 5) -> list[float]:
    """GB/s of a streaming read with the first 1..len(cpus) of `cpus` (TVM threads, pinned),
    over ``nbytes`` (default: 1 GiB, or twice the last-level cache where that is larger)."""
    max_threads = int(os.environ.get("TVM_NUM_THREADS", len(cpus)))
    probe = BandwidthProbe(cpus, cold_weight_bytes(1 << 30) if nbytes is None else nbytes, repeats)
    return [probe.sample(cpus[:n]) for n in range(1, min(len(cpus), max_threads) + 1)]


class BandwidthProbe:
    """A quick streaming read on ``cpus`` (all at once), to sample the memory bandwidth next to
    a measurement: this VM's host alternates between phases ~1.6x apart (minutes long), so a
    prediction checked against a timing needs the bandwidth of the same minutes."""

    def __init__(self, cpus: list[int], nbytes: int | None = None, repeats: int = 5) -> None:
        from ..memory import aligned_empty
        from ..tvm_compat import local_target, tvm

        nbytes = cold_weight_bytes(256 << 20) if nbytes is None else nbytes
        k = max(64, min(2048, nbytes // (64 * 32 * 4)))  # 64 rows at least: one per thread and more
        rows = max(nbytes // (k * 32 * 4), 64)
        exe = tvm.compile(tvm.IRModule({"read_sum": _read_kernel(rows, k)}), target=local_target())
        # Huge pages, as the runtime's weights use (a 4 KiB-page read runs ~1.4x slower).
        host = aligned_empty((rows, k, 4, 8))
        host[...] = 1.0  # touched: real pages
        self.cpus = list(cpus)
        self.nbytes = host.nbytes
        self._data = tvm.runtime.from_dlpack(host)
        self._out = tvm.runtime.empty((rows, 4, 8), "float32", tvm.cpu())
        self._timer = exe.mod.time_evaluator("read_sum", tvm.cpu(), number=1, repeat=repeats)
        self.samples: list[float] = []

    def sample(self, cpus: list[int] | None = None) -> float:
        """GB/s (median of the reads) with the pool on ``cpus`` (default: the probe's); the
        previous pool shape is restored."""
        from ..tvm_compat import pin_thread_pool

        before = os.sched_getaffinity(0)
        try:
            pin_thread_pool(cpus or self.cpus)
            gbs = self.nbytes / float(np.median(self._timer(self._data, self._out).results)) / 1e9
        finally:
            pin_thread_pool(sorted(before)[:int(os.environ.get("TVM_NUM_THREADS", len(before)))])
            os.sched_setaffinity(0, before)
        self.samples.append(gbs)
        return gbs


def fma_gflops(cpu: int) -> float:
    """The fp32 FMA peak of one core (``cpu``), the process's pool and affinity restored after."""
    from ..kernels.peak import fma_peak_gflops
    from ..tvm_compat import pin_thread_pool

    before = os.sched_getaffinity(0)
    try:
        return fma_peak_gflops(1, cpus=[cpu])
    finally:
        pin_thread_pool(sorted(before)[:int(os.environ.get("TVM_NUM_THREADS", len(before)))])
        os.sched_setaffinity(0, before)


def attention_gflops(cpu: int, tokens: int = 512, heads: int = 8, head_dim: int = 64) -> float:
    """GFLOPS of the model's causal prefill attention kernel on one core (``cpu``)."""
    from ..kernels.attention import prefill_ragged_primfunc
    from ..tvm_compat import local_target, pin_thread_pool, tvm

    run = tvm.compile(prefill_ragged_primfunc(heads, heads, head_dim), target=local_target(1))
    rng = np.random.default_rng(0)
    q, k, v = (tvm.runtime.tensor(rng.standard_normal((tokens, heads, head_dim), np.float32))
               for _ in range(3))
    indptr = tvm.runtime.tensor(np.array([0, tokens], np.int32))
    pos, offset = (tvm.runtime.tensor(np.zeros(n, np.int32)) for n in (tokens, 1))
    out = tvm.runtime.empty((tokens, heads, head_dim), "float32", tvm.cpu())
    lse = tvm.runtime.empty((tokens, heads), "float32", tvm.cpu())
    before = os.sched_getaffinity(0)
    try:
        pin_thread_pool([cpu])
        timer = run.mod.time_evaluator("batch_prefill_ragged_kv", tvm.cpu(), number=3, repeat=5)
        secs = float(np.median(timer(q, indptr, k, v, indptr, pos, offset, out, lse, 1, 0, 1.0, 1e4,
                                     head_dim ** -0.5).results))
    finally:
        pin_thread_pool(sorted(before)[:int(os.environ.get("TVM_NUM_THREADS", len(before)))])
        os.sched_setaffinity(0, before)
    return 2 * tokens * (tokens + 1) * heads * head_dim / secs / 1e9  # QK and PV over the causal half


def profile_key(tree: TopoTree, cpu_model: str) -> str:
    """The cached profile's name: this CPU's signature (not its model name, which clouds mask)
    and the tree measured."""
    from ..host import host_signature

    text = json.dumps([PROFILE_VERSION, cpu_model, host_signature().to_json(), tree.summary(), tree.pus])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def measure_profile(tree: TopoTree, cpu_model: str, *, refresh: bool = False,
                    log: Callable[[str], None] = lambda msg: None) -> MachineProfile:
    """Microbenchmark this machine (or reuse the cached result for this CPU and tree)."""
    from ..host import require_own_cpu
    from ..tvm_compat import host_isa

    require_own_cpu("profiling the machine")

    path = cache_dir() / "profiles" / f"{profile_key(tree, cpu_model)}.json"
    if path.is_file() and not refresh:
        log(f"machine profile: cached {path}")
        return MachineProfile.from_dict(json.loads(path.read_text()), where=str(path))
    first_domain = tree.domains[0]
    cpus = [pu for pu, dom in zip(tree.pus, tree.domains, strict=True) if dom == first_domain]
    log("microbenchmark: one core's fp32 FMA peak ...")
    gflops = fma_gflops(cpus[0])
    log(f"microbenchmark: streaming read with 1..{len(cpus)} cores ...")
    curve = read_bandwidth(cpus)
    llc = last_level_cache_bytes()
    log(f"microbenchmark: reading {llc // 2 >> 20} MiB (half the last-level cache) again and again "
        f"with {len(cpus)} cores ...")
    llc_gbs = BandwidthProbe(cpus, llc // 2).sample()
    log("microbenchmark: prefill attention on one core ...")
    attention = attention_gflops(cpus[0])
    profile = MachineProfile(
        name="this-machine",
        gflops_per_core=round(gflops, 2),
        resources=(Resource("NUMANode", "numa", tuple(round(b, 2) for b in curve)),),
        cpu_model=cpu_model,
        isa=host_isa(),
        pu_count=len(tree.pus),
        source="measured",
        allreduce_gbs=round(curve[-1] / 2, 2),
        llc_gbs_per_core=round(llc_gbs / len(cpus), 2),
        attention_efficiency=round(min(1.0, attention / gflops), 3),
        notes=f"measured {time.strftime('%Y-%m-%d %H:%M')}",
    )
    save_atomic(path, profile.to_json())
    log(f"machine profile: saved {path}")
    return profile
