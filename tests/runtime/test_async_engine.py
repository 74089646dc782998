"""The asyncio face of the engine when its thread dies: every request it holds, and every one
still in its inbox, gets an error event (none waits forever), and later ones are refused."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from sandwich_tvm.runtime.async_engine import AsyncEngine, EngineDead
from sandwich_tvm.runtime.sampling import SamplingParams


class DyingBatch:
    """Takes requests; its first step waits for ``go``, then raises (a bug in the engine)."""

    policy = SimpleNamespace(max_batch=4, max_queue=4)

    def __init__(self):
        self.added: list[str] = []
        self.stepping, self.go = threading.Event(), threading.Event()

    def check(self, prompt, max_tokens) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.added)

    def add(self, rid, prompt, params, arrival, constraint) -> None:
        self.added.append(rid)

    def step(self):
        self.stepping.set()
        self.go.wait(10)
        raise RuntimeError("boom")

    def abort(self, rid):
        return None

    def update_gauges(self) -> None:
        pass


async def _first(engine: AsyncEngine, rid: str):
    async for event in engine.generate(rid, [1, 2], SamplingParams(max_tokens=4)):
        return event
    return None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it dies raising
def test_a_dead_engine_answers_running_and_queued_requests():
    batch = DyingBatch()
    engine = AsyncEngine(batch).start()

    async def scenario():
        running = asyncio.create_task(_first(engine, "a"))
        await asyncio.to_thread(batch.stepping.wait, 10)  # "a" is in the step that will fail
        queued = asyncio.create_task(_first(engine, "b"))  # waits in the inbox meanwhile
        await asyncio.sleep(0.05)
        batch.go.set()
        return await asyncio.wait_for(asyncio.gather(running, queued), 10)

    a, b = asyncio.run(scenario())
    for event in (a, b):
        assert event.finish_reason == "error" and "RuntimeError: boom" in event.error
    assert batch.added == ["a"] and not engine.alive
    with pytest.raises(EngineDead, match="boom"):
        asyncio.run(_first(engine, "c"))
    assert "boom" in engine.swap_kernels(object(), timeout=5)  # refused at once, not timed out
