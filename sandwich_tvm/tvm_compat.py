"""Every TVM import and host-target decision in one place (names moved between versions).

Importing this module sets ``TVM_NUM_THREADS`` to the CPUs this process may use before
TVM's thread pool starts: on x86 TVM otherwise assumes SMT and starts half as many. A value
the user set is checked (``host.tvm_num_threads``): not a number, or more threads than CPUs,
raises ``HostError`` before TVM reads it.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import platform
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

from .host import (
    BF16_UNITS,
    INT8_UNITS,
    PROCESS_CPUS,
    HostError,
    cache_dir,
    cpu_flags,
    cpu_has,
    described_cpu,
    enable_amx,
    host_isa,
    isa_of,
    llvm_mattr,
    machine,
    own_cpu_flags,
    save_atomic,
    tvm_num_threads,
)

# Read before TVM's pool starts (and re-pins the calling thread, notes §5).
os.environ["TVM_NUM_THREADS"] = str(tvm_num_threads())

import tvm  # noqa: E402

enable_amx()  # every process that runs our kernels imports TVM through here (Disco workers too)
from tvm.script import tirx as T  # noqa: E402,F401

__all__ = ["tvm", "T", "host_target", "host_isa", "isa_target", "cpu_flags", "parse_tvmscript",
           "PROCESS_CPUS"]


class _Decorators:
    """Stand-in for ``T`` in a generated function's decorator line (``@D.prim_func(...)``).

    The parser evaluates the decorator only for its dispatch token (the keywords such as
    ``s_tir=True`` are read from the syntax tree). ``T.prim_func(...)`` itself calls
    ``inspect.stack()``, which reads the source of every frame of the parser's deep recursion:
    0.1-0.2 s per parse, most of the kernel tuner's build time.
    """

    @staticmethod
    def prim_func(**_kwargs):
        def decorator(func):  # never called by the parser
            raise TypeError("parse_tvmscript decorators only mark source text")

        decorator.dispatch_token = "tirx"
        return decorator


@lru_cache(maxsize=1)
def preload_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (every ``MetaSchedule.TuneContext`` does) cheaply.

    The import parses a few hundred ``@T.prim_func`` intrinsics, and each decorator calls
    ``inspect.stack()``, which reads the source context of every frame: ~30 s here. The
    decorator only looks at the context of the first three frames (and at frame locals), so
    for this import the deeper frames are listed without their source.
    """
    import inspect
    import sys

    real = inspect.stack

    def stack(context: int = 1) -> list:
        frames, frame, depth = [], sys._getframe(1), 0
        while frame is not None:
            if depth < 4:
                info = inspect.getframeinfo(frame, context)
                frames.append(inspect.FrameInfo(frame, *info, positions=info.positions))
            else:
                code = frame.f_code
                frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name,
                                                None, None, positions=None))
            frame, depth = frame.f_back, depth + 1
        return frames

    inspect.stack = stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = real


# Parsed kernels by their source, most recently used last: a model's build parses the same
# generated kernels as the build before it (another stage, rank or plan of the same model, its
# rebuild once a record lands, the tests' many small builds). TVM's IR is immutable, so one
# PrimFunc serves every module it goes into. Kept up to PARSED_SOURCE_BYTES of source text
# (a parsed kernel holds about 18 bytes of IR per byte of its source), and on disk in the
# cache (``parsed_path``) for the next process.
PARSED_SOURCE_BYTES = 2 << 20
_parsed: OrderedDict[bytes, tuple[object, bool, int]] = OrderedDict()
_parsed_lock = threading.Lock()


@lru_cache(maxsize=1)
def _parser_build() -> str:
    """The TVM build whose parser made a kept kernel: its JSON holds LLVM's intrinsic ids,
    which change between LLVM versions and builds, so the versions, LLVM's, and the compiler
    library's size and time name the folder."""
    import tvm_ffi

    lib = Path(tvm.__file__).parent / "lib" / "libtvm_compiler.so"
    try:
        st = lib.stat()
        stamp = f"{st.st_size}-{st.st_mtime_ns}"
    except OSError:
        stamp = "no-lib"
    llvm = tvm.target.codegen.llvm_version_major()
    build = f"{tvm.__version__}|{tvm_ffi.__version__}|{llvm}|{stamp}"
    return f"tvm-{tvm.__version__}-llvm{llvm}-{hashlib.sha256(build.encode()).hexdigest()[:12]}"


def parsed_path(src: str) -> Path:
    """Where the kernel parsed from ``src`` is kept between processes: TVM's JSON form of the
    PrimFunc, gzipped, named by the source's hash, under the TVM build that parsed it."""
    return _kept_path(hashlib.sha256(src.encode()).digest())


def _kept_path(key: bytes) -> Path:
    return cache_dir() / "kernels" / _parser_build() / f"{key.hex()}.json.gz"


def _load_parsed(path: Path):
    """The PrimFunc kept at ``path``, or None: missing, unreadable or damaged (gzip's checksum,
    a cut file, not a PrimFunc), in which case it is parsed again and the file replaced."""
    try:
        func = tvm.ir.load_json(gzip.decompress(path.read_bytes()).decode())
    except Exception:  # noqa: BLE001 (any damage means: parse the source again)
        return None
    return func if isinstance(func, tvm.tirx.PrimFunc) else None


def _store_parsed(path: Path, func) -> None:
    # best effort (a read-only or full cache, a kernel TVM cannot save): the next process parses it
    with contextlib.suppress(Exception):
        save_atomic(path, gzip.compress(tvm.ir.save_json(func).encode(), compresslevel=1))


def parse_tvmscript(src: str, check_well_formed: bool = True, reuse: bool = True):
    """Parse generated TVMScript whose function is decorated ``@D.prim_func(s_tir=True)``.
    The tuner skips the well-formedness check (a third of the parse time) for candidates of a
    generator the tests check, and keeps nothing it parses (``reuse=False``: each candidate is
    parsed once); compiling still validates the lowered code. A source parsed before (and
    checked, if asked), in this process or, checked, in another, is not parsed again."""
    key = hashlib.sha256(src.encode()).digest()
    with _parsed_lock:
        hit = _parsed.get(key)
        if hit is not None and (hit[1] or not check_well_formed):
            _parsed.move_to_end(key)
            return hit[0]
    path = _kept_path(key) if reuse else None
    func = _load_parsed(path) if path is not None else None
    checked = func is not None or check_well_formed  # only checked parses are kept on disk
    if func is None:
        func = tvm.script.from_source(src, extra_vars={"T": T, "D": _Decorators},
                                      check_well_formed=check_well_formed)
        if path is not None and check_well_formed:
            _store_parsed(path, func)
    if reuse and len(src) <= PARSED_SOURCE_BYTES:
        with _parsed_lock:
            _parsed[key] = (func, checked, len(src))
            while sum(size for _, _, size in _parsed.values()) > PARSED_SOURCE_BYTES:
                _parsed.popitem(last=False)
    return func


def _mcpu(isa: str) -> str:
    # LLVM names this Zen3 VM "znver4" and would emit AVX-512 it does not have, so the
    # CPU name is trusted only when its ISA matches the flags the kernel reports.
    system = tvm.target.codegen.llvm_get_system_cpu()
    if isa == "avx512" or isa == "neon":
        return system
    if isa == "avx2":
        return "znver3" if system.startswith("znver") else "x86-64-v3"
    return "x86-64"


def host_target(num_cores: int | None = None) -> tvm.target.Target:
    """An llvm target for the CPU code is built for (dict form; MetaSchedule needs num-cores):
    this one (``local_target``), or the one ``SANDWICH_CPU`` describes, by its architecture,
    a generic CPU name of its ISA and its flags."""
    if described_cpu() is None:
        return local_target(num_cores)
    cores = num_cores or int(os.environ["TVM_NUM_THREADS"])
    arch, isa = machine(), host_isa()
    mcpu = "generic" if arch == "aarch64" else {"avx512": "x86-64-v4", "avx2": "x86-64-v3"}.get(isa, "x86-64")
    return tvm.target.Target({"kind": "llvm", "mtriple": f"{arch}-linux-gnu", "mcpu": mcpu,
                              "mattr": llvm_mattr(), "num-cores": cores})


def local_target(num_cores: int | None = None) -> tvm.target.Target:
    """An llvm target for this machine, whatever ``SANDWICH_CPU`` says: for code this process
    runs itself (the thread pool's warm-up, bandwidth and FMA probes).

    ``mattr`` lists the features the CPU flags report (AMX, AVX512-BF16, ...), which LLVM's
    name for a masked or virtual CPU may lack ("rocketlake" for a Sapphire Rapids VM), and
    switches off the wide ones it lacks (LLVM calls some AVX2-only Zen VMs "znver4").
    """
    cores = num_cores or int(os.environ["TVM_NUM_THREADS"])
    flags = own_cpu_flags()
    target = {"kind": "llvm", "mcpu": _mcpu(isa_of(flags)), "num-cores": cores}
    mattr = llvm_mattr(flags)
    if mattr:
        target["mattr"] = mattr
    return tvm.target.Target(target)


# A representative LLVM target per ISA, to build (not run) kernels for CPUs other than this one.
_ISA_TARGETS = {
    "avx2": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v3"},
    "avx512": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v4"},
    "avx512bf16": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v4", "mattr": ["+avx512bf16"]},
    "amx": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v4",
            "mattr": ["+avx512bf16", "+amx-tile", "+amx-bf16"]},
    "avx512vnni": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v4", "mattr": ["+avx512vnni"]},
    "amxint8": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v4",
                "mattr": ["+avx512vnni", "+amx-tile", "+amx-int8"]},
    "amxdq": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v4",
              "mattr": ["+avx512vnni", "+avx512bf16", "+amx-tile", "+amx-bf16"]},
    "avxvnni": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v3", "mattr": ["+avxvnni"]},
    "avx2dot": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v3"},
    "avx512dot": {"mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v4"},
    "neondot": {"mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": ["+neon", "+dotprod"]},
    "neon": {"mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": ["+neon"]},
    "neonbf16": {"mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": ["+neon", "+bf16"]},
}


def cross_linker(triple: str):
    """A TVM ``fcompile`` linking objects for ``triple`` with ``zig cc`` (the ``ziglang`` wheel:
    a C toolchain for every target, its compiler-rt included), or None where it is not installed."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("ziglang") is None:
        return None

    def link(output: str, objects: list[str], options=None) -> None:
        subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", triple, "-shared", "-fPIC",
                        "-o", output, *objects], check=True)

    link.output_format = "so"  # type: ignore[attr-defined]
    return link


def linker_for(target: tvm.target.Target):
    """``export_library``'s ``fcompile`` for ``target``: None (this machine's compiler) or a
    cross linker; a ``HostError`` naming what to install where there is none."""
    triple = str(target.attrs.get("mtriple", ""))
    arch = triple.split("-")[0]
    if arch in ("", platform.machine()):
        return None
    linker = cross_linker(f"{arch}-linux-gnu")
    if linker is None:
        raise HostError(f"code built for {triple} needs a linker for it, and this {platform.machine()} "
                        "machine has none: pip install ziglang, or build there")
    return linker


def isa_target(isa: str, num_cores: int = 2) -> tvm.target.Target:
    """The host target when ``isa`` is this CPU's (or its bf16 dot-product extension and this
    CPU has it), else a generic target of that ISA."""
    units = BF16_UNITS.get(host_isa(), ()) + INT8_UNITS.get(host_isa(), ())
    if isa == host_isa() or (isa in units and cpu_has(isa)):
        return host_target(num_cores)
    if isa not in _ISA_TARGETS:
        raise ValueError(f"no target for ISA {isa!r}; known: {sorted(_ISA_TARGETS)}")
    return tvm.target.Target({"kind": "llvm", **_ISA_TARGETS[isa], "num-cores": num_cores})


def target_isa(target: tvm.target.Target) -> str:
    """The vector ISA an llvm target builds for (its -mattr, triple and CPU name)."""
    attrs = target.attrs
    mattr = [str(a) for a in attrs.get("mattr", [])]
    triple, mcpu = str(attrs.get("mtriple", "")), str(attrs.get("mcpu", ""))
    if triple.startswith("aarch64") or "+neon" in mattr:
        return "neon"
    if "+avx512f" in mattr or mcpu in ("x86-64-v4", "skylake-avx512") and "-avx512f" not in mattr:
        return "avx512"
    if "+avx2" in mattr or mcpu == "x86-64-v3" or mcpu.startswith("znver"):
        return "avx2"
    return host_isa() if not triple else "generic"


_POOL = threading.local()  # TVM's pool is per calling thread (a Disco worker 0 runs in its own)


def pin_thread_pool(cpus: list[int]) -> None:
    """Re-shape TVM's thread pool to one worker per CPU of ``cpus`` (worker i on ``cpus[i]``).

    TVM starts its pool lazily, and a pool first configured with fewer workers than
    ``TVM_NUM_THREADS`` never grows back (measured: a later 2-thread run stays at 1-thread
    speed), so the pool is started at full size with one parallel no-op before the first call.
    The pool belongs to the calling thread (TVM keeps one per thread).
    """
    if not getattr(_POOL, "started", False):
        _warm_pool_kernel()(tvm.runtime.empty((64,), "float32", tvm.cpu()))
        _POOL.started = True
    tvm.get_global_func("runtime.config_threadpool")(-2, len(cpus), [str(c) for c in cpus])


@lru_cache(maxsize=1)
def _warm_pool_kernel():
    @T.prim_func
    def warm(a: T.Buffer((64,), "float32")):
        for i in T.parallel(64):
            a[i] = T.float32(0)

    return tvm.compile(tvm.IRModule({"warm": warm}), target=local_target())["warm"]


def tensor_from_numpy(a):
    """A TVM tensor sharing ``a``'s memory (zero-copy). DLPack has no code for ml_dtypes'
    bfloat16, so such arrays go over as their 16-bit words and come back as a bfloat16 view of
    the same buffer (the widening kernels' bf16 weights, on CPUs without a bf16 unit)."""
    import numpy as np

    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return tvm.runtime.from_dlpack(a.view(np.uint16))._create_view(a.shape, "bfloat16")
    return tvm.runtime.from_dlpack(a)
