"""A pipeline step relayed by the controller: for ranks on other hosts, where no shared memory
joins them, every exchange of a step (``StageEngine``'s all-gather of hidden states, and the
sum that brings the last stage's hidden states back to stage 0's head) goes through the
controller over Disco's ``SocketSession``, whose channel carries plain values (here bytes),
not tensors.

Each rank runs the step up to its next exchange and answers with ``pack(op, its array)``; the
controller checks that the ranks agree (``unpack_all``: the same exchange, the same shape, or
a rank's error), combines their arrays (``combine``) and sends the result back to every rank,
which runs on to the next exchange, until each answers ``DONE`` (rank 0 with the logits).
Disco's sockets carry bytes at some tens of MB/s in TVM 0.27 (``bench hop``), so they are
spared: an array of zeros travels as its shape, and the last stage's hidden states, which only
stage 0's head reads, are handed to rank 0 in this process (it is a thread of the controller)
instead of being sent to every rank.
"""

from __future__ import annotations

import struct

import numpy as np

from .stage import GATHER, REDUCE

DONE, ERROR = "done", "error"
_CODES = {GATHER: b"g", REDUCE: b"r", DONE: b"d", ERROR: b"e"}
_OPS = {v: k for k, v in _CODES.items()}
_HEADER = struct.Struct("<cii?")  # op, rows, columns, all zeros; then float32 data (or an error's text)


MAX_VALUES = 1 << 28  # floats in one exchange: far beyond a prefill chunk's hidden states


class RelayError(RuntimeError):
    """A rank's answer the controller cannot use; the message names the rank."""


def pack(op: str, array: np.ndarray | None = None) -> bytes:
    """A rank's answer: an exchange and its array (2-D float32), or DONE and its logits."""
    a = np.zeros((0, 0), np.float32) if array is None else np.ascontiguousarray(array, np.float32)
    a = a.reshape(len(a), -1) if a.ndim != 2 else a
    if not a.any():  # a stage with nothing to hand on: its shape only (Disco's sockets are slow)
        return _HEADER.pack(_CODES[op], *a.shape, True)
    return _HEADER.pack(_CODES[op], *a.shape, False) + a.tobytes()


def pack_error(message: str) -> bytes:
    return _HEADER.pack(_CODES[ERROR], 0, 0, False) + message.encode("utf-8", "replace")


def unpack(data: bytes, rank: int) -> tuple[str, np.ndarray]:
    """``(op, array)`` of one rank's answer; a rank's error or a malformed answer raises."""
    data = bytes(data)
    if len(data) < _HEADER.size or data[:1] not in _OPS:
        raise RelayError(f"rank {rank} answered {len(data)} bytes that are not a pipeline exchange")
    code, rows, cols, zeros = _HEADER.unpack_from(data)
    op = _OPS[code]
    if op == ERROR:
        raise RelayError(f"rank {rank}: {data[_HEADER.size:].decode('utf-8', 'replace')}")
    body = data[_HEADER.size:]
    if rows < 0 or cols < 0 or rows * cols > MAX_VALUES:
        raise RelayError(f"rank {rank} answered a {rows}x{cols} array, more than any exchange holds")
    if zeros and not body:
        return op, np.zeros((rows, cols), np.float32)
    if len(body) != 4 * rows * cols:
        raise RelayError(f"rank {rank} answered a {rows}x{cols} array in {len(body)} bytes")
    return op, np.frombuffer(body, np.float32).reshape(rows, cols)


def unpack_all(answers: list[bytes]) -> tuple[str, list[np.ndarray]]:
    """Every rank's answer to one exchange: they must agree on it (and, but for DONE, on its shape)."""
    ops_arrays = [unpack(a, r) for r, a in enumerate(answers)]
    op, first = ops_arrays[0]
    for r, (o, a) in enumerate(ops_arrays[1:], start=1):
        if o != op or (op != DONE and a.shape != first.shape):
            raise RelayError(f"rank {r} answered {o} {a.shape} where rank 0 answered {op} {first.shape}: "
                             "the ranks are out of step")
    return op, [a for _, a in ops_arrays]


def combine(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    """An exchange's result: the arrays side by side (GATHER; but the last stage's, which
    hands nothing on and which no stage reads) or their sum (REDUCE)."""
    if op == GATHER:
        return np.concatenate(arrays[:-1] if len(arrays) > 1 else arrays, axis=1)
    if op == REDUCE:
        return np.sum(arrays, axis=0, dtype=np.float32)
    raise RelayError(f"{op} is not an exchange")
