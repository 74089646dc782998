"""The batch engine on its own thread, with an asyncio face for the HTTP server.

The engine thread owns the model, the KV cache and TVM's thread pool (TVM's pool belongs to
the OS thread that calls it): it drains an inbox of new requests and cancellations between
iterations, runs ``BatchEngine.step`` while there is work, and hands every ``TokenEvent`` to
the asyncio queue of its request with ``loop.call_soon_threadsafe``. Tokenization, chat
templates and HTTP stay on the event loop's thread, so they never stall an iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from .batch import BatchEngine, TokenEvent
from .grammar import Constraint
from .sampling import SamplingParams
from .scheduler import QueueFull


class EngineDead(RuntimeError):
    """The engine thread is not running (shut down or crashed); the message says why."""


@dataclass
class _Add:
    request_id: str
    prompt: Sequence[int]
    params: SamplingParams
    arrival: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    constraint: Constraint | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Swap:
    compiled: object  # a CompiledModel of the same model with other kernels
    done: threading.Event
    error: str | None = None


class AsyncEngine:
    """``generate`` yields a request's events; leaving the iterator early cancels the request."""

    def __init__(self, batch: BatchEngine):
        self.batch = batch
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._outstanding = 0  # requests submitted and not finished
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="sandwich-engine", daemon=True)
        self._busy_listener = None
        self._busy = False

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    # ------------------------------------------------------------------ the asyncio side
    async def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                       arrival: float | None = None, constraint: Constraint | None = None
                       ) -> AsyncIterator[TokenEvent]:
        """Events of one request until its finishing event. Raises ``EngineError`` (a request
        that cannot fit), ``QueueFull`` or ``EngineDead`` before the first event."""
        if not self.alive:
            raise EngineDead(self.dead or "the engine is shut down")
        self.batch.check(prompt, params.max_tokens)  # pure: reads the config only
        policy = self.batch.policy
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:  # every KV slot busy and max_queue more waiting: refuse
            if self.dead is not None:  # checked under the lock the dying thread drains under
                raise EngineDead(self.dead)
            if self._outstanding >= policy.max_batch + policy.max_queue:
                raise QueueFull(f"{self._outstanding - policy.max_batch} requests are waiting for one of "
                                f"{policy.max_batch} batch slots (the queue holds {policy.max_queue}); "
                                "retry later")
            self._outstanding += 1
            self._inbox.put(_Add(request_id, list(prompt), params, arrival or time.perf_counter(), loop, out,
                                 constraint))
        finished = False
        try:
            while True:
                event: TokenEvent = await out.get()
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:  # the consumer left early (client gone, stop string): cancel
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def swap_kernels(self, compiled, timeout: float | None = None) -> str | None:
        """Have the engine thread run ``compiled`` (the same model, newly tuned kernels) from its
        next step on; waits for it. Returns None, or why the swap was refused."""
        item = _Swap(compiled, threading.Event())
        with self._lock:  # a dead engine's inbox is never read again
            if self.dead is not None:
                return self.dead
            self._inbox.put(item)
        if not item.done.wait(timeout):
            return "the engine did not take the swap in time"
        return item.error

    def set_busy_listener(self, listener) -> None:
        """``listener(busy)`` is called on the engine thread when work starts (True) and when the
        engine goes idle (False): background tuning runs only while it is idle."""
        self._busy_listener = listener

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.batch.has_work())
                self._set_busy(self.batch.has_work())
                if self.batch.has_work():
                    for event in self.batch.step():
                        self._send(event)
        except BaseException as err:  # noqa: BLE001 -- report to every waiting client, then stop
            with self._lock:  # no request gets into the inbox after this
                self.dead = f"the engine thread stopped: {type(err).__name__}: {err}"
            for rid in list(self._outs):
                self._send(TokenEvent(rid, None, finish_reason="error", error=self.dead))
            self._refuse_queued(self.dead)
            raise

    def _refuse_queued(self, why: str) -> None:
        """Requests and swaps still in the inbox of a dead engine: each told why, none left waiting."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Add):
                self._outs[item.request_id] = (item.loop, item.out)
                self._send(TokenEvent(item.request_id, None, finish_reason="error", error=why))
            elif isinstance(item, _Swap):
                item.error = why
                item.done.set()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        self.batch.update_gauges()

    def _set_busy(self, busy: bool) -> None:
        if busy != self._busy and self._busy_listener is not None:
            self._busy_listener(busy)
        self._busy = busy

    def _handle(self, item: _Add | _Abort | _Swap) -> None:
        if isinstance(item, _Swap):
            from .engine import EngineError

            try:
                self.batch.engine.swap_kernels(item.compiled)
            except EngineError as err:
                item.error = str(err)
            item.done.set()
            return
        if isinstance(item, _Abort):
            event = self.batch.abort(item.request_id)
            if event is not None:
                self._send(event)
            return
        self._outs[item.request_id] = (item.loop, item.out)
        try:
            self.batch.add(item.request_id, item.prompt, item.params, item.arrival, item.constraint)
        except (QueueFull, ValueError) as err:
            self._send(TokenEvent(item.request_id, None, finish_reason="error", error=str(err)))

    def _send(self, event: TokenEvent) -> None:
        target = self._outs.get(event.request_id)
        if target is None:
            return
        if event.finish_reason is not None:
            del self._outs[event.request_id]
            with self._lock:
                self._outstanding -= 1
        loop, out = target
        with contextlib.suppress(RuntimeError):  # the client's loop is closed
            loop.call_soon_threadsafe(out.put_nowait, event)
