"""A shared-memory all-reduce for processes on one machine (the paper's CPU collective).

The controller creates one segment per process group (``ShmGroup.create``); every rank maps
it (``ShmGroup.attach``) and calls ``allreduce`` in the same order. The hot loop is C++
(``shm_allreduce.cc``), compiled once per CPU with ``tvm_ffi.cpp`` and registered as the
global function ``sandwich.shm_allreduce`` so TVM code (Relax's ``R.call_dps_packed``, a
Disco worker) can call it too.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import secrets
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..host import cache_dir, file_lock, host_signature

SHM_DIR = Path("/dev/shm")  # POSIX shared memory on Linux
LINE = 128  # bytes per rank's arrival counter
MAX_RANKS = 64  # ranks of one process group
ONE_SHOT_BYTES = 64 << 10  # up to this, every rank reduces the whole message itself
BLOCK_BYTES = 256 << 10  # larger messages go in blocks of this (their working set stays in cache)
DEFAULT_TIMEOUT_S = 60.0


class CollectiveError(RuntimeError):
    """The process group cannot run the collective; the message says why."""


def slot_bytes(max_bytes: int) -> int:
    """A slot for messages up to ``max_bytes``: whole pages, and one to spare (two blocks of a
    blocked message are staged side by side and may round up past the message)."""
    return -(-max(int(max_bytes), 4) // 4096) * 4096 + 4096


def segment_bytes(world: int, slot: int) -> int:
    """Counters, then two buffer sets of ``world`` input slots and one result slot."""
    return LINE * world + 2 * (world + 1) * slot


@lru_cache(maxsize=1)
def _kernel():
    """The compiled all-reduce (built once per CPU signature, then loaded from the cache; the
    ranks of a new group start together, so the build is locked: one compiles, the others wait
    and load its library instead of reading it half-written)."""
    import tvm_ffi
    import tvm_ffi.cpp

    src = (Path(__file__).with_name("shm_allreduce.cc")).read_text()
    build = cache_dir() / "collective" / host_signature().slug
    build.mkdir(parents=True, exist_ok=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # ninja
    try:
        with file_lock(build / ".lock"):
            mod = tvm_ffi.cpp.load_inline("sandwich_shm_allreduce", cpp_sources=src,
                                          functions=["shm_allreduce_f32", "shm_allgather_f32"],
                                          extra_cflags=["-O3", "-march=native"], build_directory=str(build))
    except Exception as err:  # a compiler or ninja problem: say what to install
        raise CollectiveError(f"building the shared-memory all-reduce failed ({err}); it needs a C++ "
                              "compiler (g++) and ninja (pip install ninja)") from err
    tvm_ffi.register_global_func("sandwich.shm_allreduce_f32", mod.shm_allreduce_f32, override=True)
    tvm_ffi.register_global_func("sandwich.shm_allgather_f32", mod.shm_allgather_f32, override=True)
    return mod


@dataclass
class ShmGroup:
    """One rank's view of a process group's segment (``world`` ranks, messages up to ``slot``
    bytes). ``seq`` counts this rank's collectives; every rank calls them in the same order."""

    name: str
    rank: int
    world: int
    slot: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    seq: int = 0
    block_bytes: int = BLOCK_BYTES
    _map: mmap.mmap | None = field(default=None, repr=False)
    _seg: np.ndarray | None = field(default=None, repr=False)
    owner: bool = False

    @classmethod
    def create(cls, world: int, max_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> ShmGroup:
        """The controller's segment (rank 0's view); pass ``name`` and ``slot`` to the workers.
        The segment is a file in /dev/shm that only the owner removes (``close``): Python's
        ``SharedMemory`` would let a worker's resource tracker remove it when that worker exits."""
        if world < 1 or world > MAX_RANKS:
            raise CollectiveError(f"a group has 1..{MAX_RANKS} ranks, not {world}")
        if not SHM_DIR.is_dir():
            raise CollectiveError(f"{SHM_DIR} does not exist: this system has no POSIX shared memory")
        slot = slot_bytes(max_bytes)
        name = f"sandwich-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, segment_bytes(world, slot))  # zero-filled: every counter starts at 0
            return cls._open(name, fd, 0, world, slot, timeout_s, owner=True)
        except BaseException:  # no group to close it: the file goes now
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str, rank: int, world: int, slot: int,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> ShmGroup:
        """A worker's view of the controller's segment ``name``."""
        if not 0 <= rank < world:
            raise CollectiveError(f"rank {rank} is outside a group of {world}")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise CollectiveError(f"shared-memory segment {name!r} does not exist; the controller has "
                                  "gone or never created it") from None
        try:
            size = os.fstat(fd).st_size
            if size < segment_bytes(world, slot):
                raise CollectiveError(f"segment {name!r} has {size} bytes, fewer than {world} ranks of "
                                      f"{slot}-byte slots need")
            return cls._open(name, fd, rank, world, slot, timeout_s, owner=False)
        finally:
            os.close(fd)

    @classmethod
    def _open(cls, name, fd, rank, world, slot, timeout_s, owner) -> ShmGroup:
        group = cls(name, rank, world, slot, timeout_s, owner=owner)
        group._map = mmap.mmap(fd, segment_bytes(world, slot))
        group._seg = np.frombuffer(group._map, np.uint8)
        group._words()[rank, 1] = os.getpid()  # peers watch it: a dead rank fails their wait fast
        return group

    def _words(self) -> np.ndarray:
        """Each rank's counter line as 64-bit words: [arrivals, pid, aborted, ...]."""
        return self._seg[: LINE * self.world].view(np.uint64).reshape(self.world, LINE // 8)

    @property
    def pids(self) -> list[int]:
        """The process id of every rank that has attached (0 for one that has not)."""
        return [int(p) for p in self._words()[:, 1]] if self._seg is not None else []

    def set_pid(self, rank: int, pid: int) -> None:
        """Record ``rank``'s process before it attaches (the controller knows its workers), so a
        rank that dies while starting fails the others' waits too."""
        self._words()[rank, 1] = pid

    def abort(self) -> None:
        """Tell the peers this rank failed: their waits raise instead of timing out."""
        if self._seg is not None:
            self._words()[self.rank, 2] = 1

    def _next_op(self, x, what: str) -> None:
        """Check that the group is open and ``x`` (float32) fits a slot; count the op."""
        if self._seg is None:
            raise CollectiveError("the group is closed")
        nbytes = 4 * math.prod(x.shape)
        if nbytes > self.slot:
            raise CollectiveError(f"{what} of {nbytes} bytes exceeds the group's {self.slot}-byte slots")
        self.seq += 1

    def allreduce(self, x, out=None, residual=None):
        """The elementwise sum of ``x`` over the ranks (float32), bit-identical on every rank, plus
        ``residual`` when given (the same on every rank; added in the same pass). ``x``,
        ``residual`` and ``out`` are numpy arrays or any DLPack tensors (TVM's, inside a model);
        ``out`` may be ``x`` or ``residual``."""
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x, dtype=np.float32)
            out = np.empty_like(x) if out is None else out
        if isinstance(residual, np.ndarray):
            residual = np.ascontiguousarray(residual, dtype=np.float32)
        self._next_op(x, "a message")
        _kernel().shm_allreduce_f32(self._seg, self.rank, self.world, self.slot, self.seq, x,
                  x if residual is None else residual, residual is not None, out, ONE_SHOT_BYTES,
                  self.block_bytes, self.timeout_s)
        return out

    def allgather(self, x, out=None, full: int | None = None):
        """Every rank's ``x`` (``[..., w]`` float32) side by side along the last axis, cut to
        ``full`` columns (default ``world * w``): rank r's part lands in columns ``r*w ..``."""
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x, dtype=np.float32)
            if out is None:
                out = np.empty((*x.shape[:-1], full or self.world * x.shape[-1]), np.float32)
        self._next_op(x, "a part")
        _kernel().shm_allgather_f32(self._seg, self.rank, self.world, self.slot, self.seq, x, out,
                                    self.timeout_s)
        return out

    def close(self) -> None:
        """The owner removes the segment; every rank unmaps it (or, while a view of it is still
        alive somewhere, leaves the mapping to go with the last view)."""
        if self._map is None:
            return
        self._seg = None
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
        with contextlib.suppress(BufferError):  # a numpy or DLPack view outlives the group
            self._map.close()
        self._map = None

    def __enter__(self) -> ShmGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
