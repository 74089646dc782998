"""Facts about the machine we run on, in one place: CPU signature, ISA, caches, cache dirs, files.

Pure Python (no TVM import), so every layer may use it. The CPU *signature* identifies the
hardware a tuning record, a machine profile or a compiled artifact is valid for. It does not
trust the model name (clouds mask it: "Intel(R) Xeon(R) Processor", "AMD EPYC"): it is the
vendor, family/model/stepping, the ISA features that change generated code and the cache sizes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path


class HostError(RuntimeError):
    """The environment or a host directory is unusable; the message says what to change."""


# /proc/cpuinfo flags that change the code LLVM may emit, and their LLVM feature names.
LLVM_FEATURES: dict[str, str] = {
    "sse4_2": "sse4.2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16", "avx512vbmi": "avx512vbmi", "avx_vnni": "avxvnni",
    "amx_tile": "amx-tile", "amx_bf16": "amx-bf16", "amx_int8": "amx-int8",
    # Arm (the cpuinfo "Features" line)
    "asimd": "neon", "asimdhp": "fullfp16", "sve": "sve", "sve2": "sve2", "bf16": "bf16", "i8mm": "i8mm",
    "asimddp": "dotprod",
}
# Features the target switches off though the CPU has them: TVM 0.27 lowers loops for SVE with
# scalable vectors and emits LLVM that fails verification (``get.active.lane.mask`` with
# mismatched types, seen building the model for an SVE Arm CPU); the kernels are NEON.
_NOT_TARGETED = {"sve", "sve2"}
_X86_FAMILIES = ("avx512f", "amx_tile", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


# SANDWICH_CPU=FILE builds for another CPU (cross-compiling, as MLC-LLM's --host does): the
# JSON ``python -m sandwich_tvm.host --describe`` printed on that CPU. Its machine, flags,
# /proc/cpuinfo fields and cache sizes replace this one's where code is built or keyed (ISA,
# LLVM target, kernels, CPU signature and records); the core count and topology stay this
# machine's. Code this process runs itself (thread-pool warm-up, probes) is built for this
# CPU (``tvm_compat.local_target``), and what would run the described CPU's code here (serving,
# generating, tuning, probing) refuses to start (``require_own_cpu``).
_DESCRIPTION_KEYS = {"machine": str, "flags": list, "cpuinfo": dict, "caches_kib": list}
MACHINES = ("x86_64", "aarch64")  # the architectures the kernels know


def _description_error(path: str, what: str) -> HostError:
    return HostError(f"SANDWICH_CPU={path} {what}; write it with `python -m sandwich_tvm.host --describe "
                     "> FILE` on that CPU, or unset it")


@lru_cache(maxsize=4)
def _description(path: str, _mtime_ns: int) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise _description_error(path, f"is not a CPU description ({err})") from err
    if not isinstance(data, dict):
        raise _description_error(path, "is not a CPU description (not a JSON object)")
    bad = [k for k, kind in _DESCRIPTION_KEYS.items() if not isinstance(data.get(k), kind)]
    if bad:
        raise _description_error(path, f"lacks {', '.join(bad)}")
    if data["machine"] not in MACHINES:
        raise _description_error(path, f"describes a {data['machine']} CPU; the kernels know "
                                       f"{', '.join(MACHINES)}")
    if len(data["caches_kib"]) != 3 or not all(isinstance(v, int) and v >= 0 for v in data["caches_kib"]):
        raise _description_error(path, "lacks three cache sizes (KiB, whole numbers)")
    if not all(isinstance(f, str) for f in data["flags"]):
        raise _description_error(path, "has flags that are not names")
    return data


def described_cpu() -> dict | None:
    """The CPU ``SANDWICH_CPU`` describes, or None (build for this one)."""
    path = os.environ.get("SANDWICH_CPU", "").strip()
    if not path:
        return None
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as err:
        raise _description_error(path, f"is not a CPU description ({err})") from err
    return _description(path, mtime)


def require_own_cpu(what: str) -> None:
    """Raise ``HostError`` when ``SANDWICH_CPU`` is set: ``what`` runs code on this CPU, and
    code built for a described one may not run here (another architecture, or flags it lacks)."""
    desc = described_cpu()
    if desc is not None:
        name = desc["cpuinfo"].get("model name") or desc["machine"]
        raise HostError(f"SANDWICH_CPU is set (building for {name}), and {what} runs code on this CPU; "
                        "unset SANDWICH_CPU to run here, or run it on that CPU")


def machine() -> str:
    """The architecture code is built for (``platform.machine()`` unless ``SANDWICH_CPU``)."""
    import platform

    desc = described_cpu()
    return desc["machine"] if desc else platform.machine()


def cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (empty off Linux), or the described CPU's.
    Under user-mode emulation (qemu-aarch64 on x86) /proc/cpuinfo is the host's: this names the
    emulated CPU instead."""
    desc = described_cpu()
    return dict(desc["cpuinfo"]) if desc else _own_cpuinfo()


@lru_cache(maxsize=1)
def _own_cpuinfo() -> dict[str, str]:
    import platform

    info = _raw_cpuinfo()
    if emulated():
        return {"CPU implementer": "qemu", "model name": f"{platform.machine()} emulated on "
                                                         f"{info.get('model name', '?')}"}
    return info


@lru_cache(maxsize=1)
def _raw_cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _read("/proc/cpuinfo").splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def emulated() -> bool:
    """Whether this process runs under user-mode emulation: ``scripts/arm_env.py``'s wrapper
    says so (``SANDWICH_EMULATED``), or an aarch64 process reads an x86 /proc/cpuinfo (qemu
    before 8.1 passes the host's through)."""
    if os.environ.get("SANDWICH_EMULATED"):
        return True
    return arm_hwcaps() is not None and "flags" in _raw_cpuinfo()


# SANDWICH_MAX_ISA caps the features every layer sees, as oneDNN's ONEDNN_MAX_CPU_ISA does: the
# flags above the cap are dropped where they are read, so the ISA, the LLVM target, the kernels,
# the CPU signature (and with it the tuning records) are those of a CPU without them.
MAX_ISA_DROPS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx512", "amx_"),
    "avx512": ("avx512_bf16", "avx512_fp16", "amx_"),
    "avx512bf16": ("amx_",),
    "amx": (),
}


def max_isa() -> str | None:
    """The ``SANDWICH_MAX_ISA`` cap, or None when unset."""
    cap = os.environ.get("SANDWICH_MAX_ISA", "").strip().lower()
    if cap and cap not in MAX_ISA_DROPS:
        raise HostError(f"SANDWICH_MAX_ISA={cap!r} is not a known cap; use one of "
                        f"{', '.join(MAX_ISA_DROPS)} or unset it")
    return cap or None


# Linux's Arm hwcap bits (asm/hwcap.h) of the features above, by their cpuinfo names.
_ARM_HWCAP = {"fp": 0, "asimd": 1, "fphp": 9, "asimdhp": 10, "asimddp": 20, "sve": 22}
_ARM_HWCAP2 = {"sve2": 1, "i8mm": 13, "bf16": 14}
_AT_HWCAP, _AT_HWCAP2 = 16, 26


@lru_cache(maxsize=1)
def arm_hwcaps() -> frozenset[str] | None:
    """The Arm features the kernel gives this process (``getauxval(AT_HWCAP[2])``), by their
    cpuinfo names; None off aarch64 Linux. These, not /proc/cpuinfo, are what the process may
    execute: under user-mode emulation (qemu-aarch64) /proc/cpuinfo is the host's."""
    import ctypes
    import platform

    if platform.machine() != "aarch64":
        return None
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return None
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    cap, cap2 = getauxval(_AT_HWCAP), getauxval(_AT_HWCAP2)
    return frozenset([f for f, bit in _ARM_HWCAP.items() if cap >> bit & 1]
                     + [f for f, bit in _ARM_HWCAP2.items() if cap2 >> bit & 1])


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags (x86 ``flags``, Arm hwcaps or ``Features``; the described CPU's),
    less those above SANDWICH_MAX_ISA."""
    desc = described_cpu()
    return _capped(frozenset(desc["flags"])) if desc else _own_flags()


def _own_flags(capped: bool = True) -> frozenset[str]:
    """The flags of the CPU this process runs on (Arm: the hwcaps the kernel gives it, else
    /proc/cpuinfo's), less those above SANDWICH_MAX_ISA when ``capped``."""
    info = _own_cpuinfo()
    flags = arm_hwcaps() or frozenset((info.get("flags") or info.get("Features") or "").split())
    return _capped(flags) if capped else flags


def _capped(flags: frozenset[str]) -> frozenset[str]:
    cap = max_isa()
    if cap:
        flags = frozenset(f for f in flags if not f.startswith(MAX_ISA_DROPS[cap]))
    return flags


def isa_of(flags: frozenset[str] | set[str]) -> str:
    """The widest vector ISA the kernels know for a set of flags: avx512, avx2, neon or generic."""
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    if "asimd" in flags:
        return "neon"
    return "generic"


def host_isa() -> str:
    return isa_of(cpu_flags())


_ISA_NEEDS = {"avx512": {"avx512f", "avx2", "fma"}, "avx2": {"avx2", "fma"}, "neon": {"asimd"},
              "avx512bf16": {"avx512f", "avx2", "fma", "avx512_bf16"}, "neonbf16": {"asimd", "bf16"},
              "amx": {"avx512f", "avx2", "fma", "avx512_bf16", "amx_tile", "amx_bf16"},
              "avx512vnni": {"avx512f", "avx2", "fma", "avx512_vnni"},
              "amxint8": {"avx512f", "avx2", "fma", "avx512_vnni", "amx_tile", "amx_int8"},
              "amxdq": {"avx512f", "avx2", "fma", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"},
              "avxvnni": {"avx2", "fma", "avx_vnni"}, "avx2dot": {"avx2", "fma"},
              "avx512dot": {"avx512f", "avx2", "fma", "avx512bw"},
              "neondot": {"asimd", "asimddp"}}
# vector ISA -> the bf16 units a CPU of it may have, best first
BF16_UNITS: dict[str, tuple[str, ...]] = {"avx512": ("amx", "avx512bf16"), "neon": ("neonbf16",)}
# vector ISA -> the int8 dot-product units a CPU of it may have (block-quantized weights)
INT8_UNITS: dict[str, tuple[str, ...]] = {"avx512": ("amxdq", "amxint8", "avx512vnni", "avx512dot"),
                                          "avx2": ("avxvnni", "avx2dot"), "neon": ("neondot",)}
TILE_ISAS = ("amx", "amxint8", "amxdq")  # need the kernel's permission for the tile state


def units_of(isa: str, flags: set[str]) -> set[str]:
    """The vector ISA ``isa`` and every bf16 or int8 unit a CPU with ``flags`` has beside it."""
    units = {*BF16_UNITS.get(isa, ()), *INT8_UNITS.get(isa, ())}
    return {isa} | {u for u in units if _ISA_NEEDS.get(u, {"?"}) <= flags}


ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158


@lru_cache(maxsize=1)
def enable_amx() -> bool:
    """Ask Linux for the AMX tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``), once per process and for all its threads: without it the first tile
    instruction kills the process (SIGILL). False where the CPU or the kernel has no AMX."""
    import ctypes
    import platform

    if platform.machine() != "x86_64" or "amx_tile" not in _own_flags():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def own_cpu_flags() -> frozenset[str]:
    """The flags of the CPU this process runs on, whatever ``SANDWICH_CPU`` says (capped)."""
    return _own_flags()


def own_cpuinfo() -> dict[str, str]:
    """/proc/cpuinfo's first block for the CPU this process runs on, whatever ``SANDWICH_CPU``
    says (under emulation: naming the emulated CPU)."""
    return dict(_own_cpuinfo())


def cpu_has(isa: str) -> bool:
    """Whether the CPU code is built for (this one, or ``SANDWICH_CPU``'s) has ``isa``."""
    return isa in _ISA_NEEDS and _ISA_NEEDS[isa] <= cpu_flags()


def can_run(isa: str) -> bool:
    """Whether this CPU executes code built for ``isa`` (AVX-512 hosts also run AVX2 code); AMX
    also needs the kernel's permission, which this asks for."""
    if isa in TILE_ISAS and not enable_amx():
        return False
    return isa in _ISA_NEEDS and _ISA_NEEDS[isa] <= _own_flags()


def _cache_sizes_kib() -> tuple[int, int, int]:
    """Per-instance L1d, L2 and L3 sizes in KiB of CPU 0 (0 where sysfs does not say), or the
    described CPU's."""
    desc = described_cpu()
    return tuple(int(v) for v in desc["caches_kib"]) if desc else _own_cache_sizes_kib()  # type: ignore[return-value]


@lru_cache(maxsize=1)
def _own_cache_sizes_kib() -> tuple[int, int, int]:
    sizes = {1: 0, 2: 0, 3: 0}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")) if root.is_dir() else []:
        kind = _read(str(index / "type")).strip()
        level = _read(str(index / "level")).strip()
        size = _read(str(index / "size")).strip().upper()
        match = re.fullmatch(r"(\d+)([KMG]?)", size)
        if kind == "Instruction" or not level.isdigit() or not match:
            continue
        kib = int(match[1]) * {"": 1 / 1024, "K": 1, "M": 1024, "G": 1 << 20}[match[2]]
        sizes[int(level)] = int(kib)
    return sizes[1], sizes[2], sizes[3]


def _int(text: str | None) -> int | None:
    try:
        return int(text, 0) if text else None
    except ValueError:
        return None


@dataclass(frozen=True)
class CpuSignature:
    """What tuned kernels depend on. ``None`` fields are unknown and constrain nothing."""

    vendor: str
    model_name: str
    family: int | None
    model: int | None
    stepping: int | None
    isa: str
    features: tuple[str, ...] | None  # the LLVM_FEATURES flags present, sorted
    l1d_kib: int | None
    l2_kib: int | None
    l3_kib: int | None

    @property
    def slug(self) -> str:
        """A directory name: readable prefix + a hash of the whole signature."""
        vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(self.vendor, self.vendor.lower())
        fms = "-".join(f"{k}{v}" for k, v in (("f", self.family), ("m", self.model), ("s", self.stepping))
                       if v is not None)
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:8]
        return _slug("-".join(p for p in (vendor or "cpu", fms, self.isa, digest) if p))

    def to_json(self) -> dict:
        d = asdict(self)
        d["features"] = None if self.features is None else list(self.features)
        return d

    @classmethod
    def from_json(cls, d: dict) -> CpuSignature:
        known = {f.name for f in fields(cls)}
        missing = known - set(d)
        if missing:
            raise ValueError(f"CPU signature lacks {sorted(missing)}")
        feats = d["features"]
        if not (feats is None or isinstance(feats, list) and all(isinstance(f, str) for f in feats)):
            raise ValueError(f"CPU signature features must be a list of flags, not {feats!r}")
        feats = None if feats is None else tuple(sorted(feats))
        return cls(**{**{k: d[k] for k in known}, "features": feats})

    def differences(self, other: CpuSignature) -> list[str]:
        """Fields that differ where both sides know them, as ``name: ours != theirs``."""
        out = []
        for f in fields(self):
            if f.name == "model_name":  # informational: masked names must not decide
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is None or b is None or a == b:
                continue
            if f.name == "features":
                only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
                out.append(f"features: only here {only_a or '-'}, only there {only_b or '-'}")
            else:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out

    def describe(self) -> str:
        fms = "/".join(str(v) for v in (self.family, self.model, self.stepping))
        caches = "/".join("?" if v is None else f"{v}K" for v in (self.l1d_kib, self.l2_kib, self.l3_kib))
        name = self.model_name or self.vendor
        return f"{name} (family/model/stepping {fms}, {self.isa}, L1d/L2/L3 {caches})"


def host_signature() -> CpuSignature:
    """The signature of the CPU code is built for (this one, or ``SANDWICH_CPU``'s)."""
    desc = described_cpu()
    key = json.dumps(desc, sort_keys=True) if desc else ""
    return _signature(key, os.environ.get("SANDWICH_MAX_ISA", ""))


@lru_cache(maxsize=4)
def _signature(_described: str, _cap: str) -> CpuSignature:
    info, flags = cpuinfo(), cpu_flags()
    l1, l2, l3 = _cache_sizes_kib()
    return CpuSignature(
        vendor=info.get("vendor_id") or info.get("CPU implementer") or "unknown",
        model_name=info.get("model name") or info.get("Hardware") or "",
        family=_int(info.get("cpu family") or info.get("CPU architecture")),
        model=_int(info.get("model") or info.get("CPU part")),
        stepping=_int(info.get("stepping") or info.get("CPU revision")),
        isa=isa_of(flags),
        features=tuple(sorted(f for f in flags if f in LLVM_FEATURES)),
        l1d_kib=l1 or None, l2_kib=l2 or None, l3_kib=l3 or None,
    )


def llvm_mattr(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """``-mattr`` for LLVM from the CPU flags: every known feature the CPU has, and on x86 the
    wide families it lacks switched off, so a mis-guessed ``mcpu`` cannot emit them."""
    flags = cpu_flags() if flags is None else flags
    on = [f"+{LLVM_FEATURES[f]}" for f in sorted(flags) if f in LLVM_FEATURES and f not in _NOT_TARGETED]
    if "asimd" in flags:  # off even where the CPU name (neoverse-v1, ...) would turn them on
        return on + [f"-{LLVM_FEATURES[f]}" for f in sorted(_NOT_TARGETED)]
    if not flags:
        return on
    return on + [f"-{LLVM_FEATURES[f]}" for f in _X86_FAMILIES if f not in flags]


def half_precision_units(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """The CPU's bf16 matrix/dot-product units (AMX, AVX512-BF16): where bf16 beats fp32."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in ("amx_bf16", "avx512_bf16", "bf16") if f in flags]


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (L3, else L2), or 32 MiB when sysfs says nothing."""
    l1, l2, l3 = _cache_sizes_kib()
    return (l3 or l2 or 32 << 10) * 1024


def cold_weight_bytes(at_least: int = 96 << 20) -> int:
    """Bytes a memory-bound measurement must stream so it reads DRAM, not cache: twice the
    last-level cache and at least ``at_least`` (96 MB alone would stay resident in a 480 MiB
    L3, and a 512 MiB read would mostly hit it). The weight copies a benchmark or the tuner's
    runner rotates over, and the streaming reads of the bandwidth probes, are sized by it."""
    return max(at_least, 2 * last_level_cache_bytes())


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


# --- threads ---------------------------------------------------------------------------------

PROCESS_CPUS: frozenset[int] = frozenset(os.sched_getaffinity(0))


def tvm_num_threads() -> int:
    """The thread-pool size for TVM: ``TVM_NUM_THREADS`` if valid, else the CPUs we may use.

    More threads than CPUs make every parallel region wait on descheduled workers (decode
    measured up to ~1500x slower), so a larger value is refused.
    """
    raw = os.environ.get("TVM_NUM_THREADS")
    if raw is None:
        return len(PROCESS_CPUS)
    if not raw.strip().isdigit() or int(raw) < 1:
        raise HostError(f"TVM_NUM_THREADS={raw!r} is not a positive integer; unset it or set it to "
                        f"at most {len(PROCESS_CPUS)} (the CPUs this process may use)")
    if int(raw) > len(PROCESS_CPUS):
        raise HostError(f"TVM_NUM_THREADS={raw} exceeds the {len(PROCESS_CPUS)} CPUs this process may "
                        f"use ({sorted(PROCESS_CPUS)}); oversubscribed threads make decode orders of "
                        "magnitude slower. Unset it or lower it")
    return int(raw)


# --- files -----------------------------------------------------------------------------------

def cache_dir() -> Path:
    """Where profiles, converted weights, parsed kernels and compiled models go (``SANDWICH_CACHE``)."""
    own = os.environ.get("SANDWICH_CACHE")  # the home directory only when it is not set
    return Path(own) if own is not None else Path.home() / ".cache" / "sandwich_tvm"


def ensure_writable(path: Path, what: str = "directory") -> Path:
    """Create ``path`` if needed and check a file can be written in it, before any long work."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        hint = " (set SANDWICH_CACHE to a writable directory)" if path == cache_dir() else ""
        raise HostError(f"cannot write to the {what} {path}: {err.strerror or err}{hint}") from err
    return path


def file_mode() -> int:
    """The mode an ordinary new file gets here (0666 less the umask): what a file written under
    a temporary name (``mkstemp``'s 0600) is given before its rename, so that a shared cache or
    records directory stays readable by the others who use it."""
    try:  # read, not set: flipping the umask would race with other threads' files
        with open("/proc/self/status") as fh:
            umask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0)
        os.umask(umask)
    return 0o666 & ~umask


def save_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename: readers never see half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as fh:
            fh.write(data)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive lock on ``path`` (created if needed) for the ``with`` block: processes
    that build the same cached file one after another instead of over each other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_cpu() -> dict:
    """This CPU as ``SANDWICH_CPU`` reads it, to build for it elsewhere: every flag (a cap,
    SANDWICH_MAX_ISA, applies where it is read). Under user-mode emulation the cpuinfo names
    the emulated CPU, and the caches are the host's, which runs it."""
    import platform

    return {"machine": platform.machine(), "flags": sorted(_own_flags(capped=False)),
            "cpuinfo": _own_cpuinfo(), "caches_kib": list(_own_cache_sizes_kib())}


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m sandwich_tvm.host", description=__doc__)
    parser.add_argument("--describe", action="store_true",
                        help="print this CPU as JSON (SANDWICH_CPU=FILE builds for it elsewhere)")
    args = parser.parse_args()
    if not args.describe:
        parser.print_help()
        sys.exit(2)
    print(json.dumps(describe_cpu(), indent=1))
