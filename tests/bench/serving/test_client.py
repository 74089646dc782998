"""The streaming client against a fake server with known timings."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sandwich_tvm.bench.serving.client import RequestRecord, make_client, run_requests, send_request
from sandwich_tvm.bench.serving.workload import Request, poisson_arrivals

from .fake_server import FakeServer, FakeState


@pytest.fixture(scope="module")
def server():
    with FakeServer() as url:
        yield url


def _one(url: str, model: str, n: int = 6) -> RequestRecord:
    async def go():
        async with make_client(30) as client:
            return await send_request(client, url, model, Request([5, 6, 7, 8], n), timeout_s=30)

    return asyncio.run(go())


def test_ttft_tpot_and_tokens(server):
    rec = _one(server, "ok")
    assert rec.ok and rec.error is None
    assert rec.output_tokens == 6 and rec.prompt_tokens == 4
    assert 0.18 <= rec.ttft_s <= 0.6
    assert 0.04 <= rec.tpot_s <= 0.12
    assert rec.e2e_s == pytest.approx(rec.ttft_s + 5 * rec.tpot_s)


def test_payload_fields():
    state = FakeState(first_s=0.0, gap_s=0.0)
    with FakeServer(state) as url:
        _one(url, "m", 3)
    body = state.bodies[0]
    assert body["prompt"] == [5, 6, 7, 8] and body["max_tokens"] == 3
    assert body["stream"] is True and body["temperature"] == 0 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_token_count_without_usage(server):
    rec = _one(server, "nousage", 4)
    assert rec.ok and rec.output_tokens == 4


def test_http_error_is_a_failed_record(server):
    rec = _one(server, "bad")
    assert not rec.ok and rec.sent
    assert rec.error.startswith("HTTP 400") and "bad prompt" in rec.error
    assert rec.tpot_s is None


def test_dropped_connection_is_a_failed_record(server):
    rec = _one(server, "drop")
    assert not rec.ok and rec.error
    assert rec.output_tokens == 0


def test_refused_connection_is_a_failed_record():
    from .fake_server import free_port

    rec = _one(f"http://127.0.0.1:{free_port()}", "ok")
    assert not rec.ok and "Connect" in rec.error


def test_timeout_is_a_failed_record():
    state = FakeState(first_s=2.0)
    with FakeServer(state) as url:
        async def go():
            async with make_client(0.3) as client:
                return await send_request(client, url, "ok", Request([5] * 4, 2), timeout_s=0.3)

        rec = asyncio.run(go())
    assert not rec.ok and "timeout" in rec.error.lower()


def test_poisson_arrivals_mean_gap_and_seed():
    arr = poisson_arrivals(20000, 4.0, seed=1)
    assert arr[0] == 0.0 and all(np.diff(arr) >= 0)
    assert np.mean(np.diff(arr)) == pytest.approx(0.25, rel=0.03)
    assert arr[:50] == poisson_arrivals(50, 4.0, seed=1)
    assert arr[:50] != poisson_arrivals(50, 4.0, seed=2)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_single_mode_is_sequential():
    state = FakeState(first_s=0.05, gap_s=0.01)
    reqs = [Request([5, 6, 7, 8], 3) for _ in range(4)]
    seen = []
    with FakeServer(state) as url:
        run = asyncio.run(run_requests(url, "ok", reqs, mode="single",
                                       progress=lambda d, t: seen.append((d, t))))
    assert state.max_in_flight == 1
    assert all(r.ok and r.output_tokens == 3 for r in run.records)
    for before, after in zip(run.records, run.records[1:], strict=False):
        assert after.send_s >= before.send_s + before.e2e_s * 0.99  # sent after the previous ended
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)] and run.rate is None


def test_poisson_mode_is_open_loop_and_duration_caps():
    state = FakeState(first_s=0.3, gap_s=0.01)
    reqs = [Request([5, 6, 7, 8], 2) for _ in range(8)]
    with FakeServer(state) as url:
        run = asyncio.run(run_requests(url, "ok", reqs, mode="poisson", rate=40.0, seed=0))
        arrivals = poisson_arrivals(8, 2.0, seed=3)
        capped = asyncio.run(run_requests(url, "ok", reqs, mode="poisson", rate=2.0, seed=3,
                                          duration_s=arrivals[3] + 1e-3))
    assert state.max_in_flight > 1  # sent while others were in flight
    assert all(r.ok for r in run.records) and run.rate == 40.0
    sends = [r.send_s for r in run.records]
    assert sends == sorted(sends)
    assert [r.sent for r in capped.records] == [True] * 4 + [False] * 4
    assert all(r.ok for r in capped.records[:4])


def test_multiturn_mode_sends_a_turn_after_the_previous_answer():
    state = FakeState(first_s=0.05, gap_s=0.01)
    reqs = [Request([5, 6, 7, 8 + t], 2, conversation=c) for c in range(3) for t in range(3)]
    with FakeServer(state) as url:
        run = asyncio.run(run_requests(url, "ok", reqs, mode="multiturn", rate=50.0, seed=0, think_s=0.02))
    assert all(r.ok for r in run.records) and run.rate == 50.0
    for c in range(3):
        turns = run.records[3 * c:3 * c + 3]
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.send_s >= before.send_s + before.e2e_s * 0.99  # after the answer came back
    assert state.max_in_flight > 1  # conversations overlap
