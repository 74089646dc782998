"""An async streaming client of ``/v1/completions``: the same client code for every system.

Each request streams (``stream: true``, greedy, ``ignore_eos``, usage in the last chunk) and is
timed from the moment it is sent: TTFT to the first chunk carrying text, E2E to the end of the
stream. Runs are ``single`` (one request after another, the paper's single-sequence serving)
or ``poisson`` (open loop: each request is sent at its arrival time whatever is in flight).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from .workload import Request, poisson_arrivals

MODES = ("single", "poisson", "multiturn")


@dataclass(frozen=True)
class RequestRecord:
    """What one request measured; times in seconds. ``sent`` is False for a request a
    ``--duration`` cap kept back; ``ok`` is False (with ``error``) for a failed one."""

    prompt_tokens: int
    max_tokens: int
    sent: bool = True
    ok: bool = False
    send_s: float | None = None  # after the run started
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for a failed request or a single token."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        return cls(**d)


@dataclass
class RunResult:
    """The records of one run, in request order, its wall time (first send to last end) and the
    benchmark round it ran in."""

    mode: str
    rate: float | None
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    round: int = 0
    speculative: dict | None = None  # the server's draft counters over the run (Sandwich, drafting)


def make_client(timeout_s: float) -> httpx.AsyncClient:
    """A client without a connection cap: an open-loop run must not queue in the client."""
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def payload(model: str, req: Request) -> dict:
    return {"model": model, "prompt": list(req.prompt_ids), "max_tokens": req.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    return choices[0].get("text") or ""


async def _stream(client: httpx.AsyncClient, url: str, body: dict, start: float) -> dict:
    """Read one SSE completion stream; the measurements as RequestRecord fields."""
    ttft = first_choice = None
    chunks, usage_tokens, done = 0, None, False
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace").strip().replace("\n", " ")
            return {"error": f"HTTP {resp.status_code}: {text[:300]}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments, event names
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if not isinstance(obj, dict):
                continue
            if obj.get("error"):
                return {"error": f"server error: {json.dumps(obj['error'])[:300]}"}
            if first_choice is None and obj.get("choices"):
                first_choice = time.perf_counter() - start
            if _chunk_text(obj):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
    e2e = time.perf_counter() - start
    if not done and usage_tokens is None:
        return {"error": "stream ended before [DONE]", "e2e_s": e2e}
    out = usage_tokens if usage_tokens is not None else chunks
    ttft = ttft if ttft is not None else first_choice  # tokens whose text was all held back
    if out < 1 or ttft is None:
        return {"error": "no tokens generated", "e2e_s": e2e}
    return {"ok": True, "ttft_s": ttft, "e2e_s": e2e, "output_tokens": out}


async def send_request(client: httpx.AsyncClient, base_url: str, model: str, req: Request, *,
                       timeout_s: float = 600.0, t0: float | None = None) -> RequestRecord:
    """Send one streaming completion and time it; failures come back as records, not raised."""
    start = time.perf_counter()
    base = {"prompt_tokens": req.prompt_len, "max_tokens": req.max_tokens,
            "send_s": None if t0 is None else start - t0}
    url = base_url.rstrip("/") + "/v1/completions"
    try:
        async with asyncio.timeout(timeout_s):
            found = await _stream(client, url, payload(model, req), start)
    except TimeoutError:
        found = {"error": f"timeout after {timeout_s:g} s"}
    except httpx.TimeoutException as exc:
        found = {"error": f"timeout: {type(exc).__name__}"}
    except httpx.HTTPError as exc:
        found = {"error": f"{type(exc).__name__}: {exc}"}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        found = {"error": f"bad stream chunk: {exc}"}
    if not found.get("ok"):
        found.setdefault("e2e_s", time.perf_counter() - start)
    return RequestRecord(**base, **found)


Progress = Callable[[int, int], None]  # (requests finished, requests to send)


async def run_requests(base_url: str, model: str, requests: list[Request], *, mode: str = "single",
                       rate: float | None = None, seed: int = 0, duration_s: float | None = None,
                       timeout_s: float = 600.0, progress: Progress | None = None,
                       think_s: float = 0.0) -> RunResult:
    """Send ``requests`` one after another (``single``) or at Poisson arrival times of ``rate``
    per second without any cap on those in flight (``poisson``); ``multiturn``: conversations
    (``Request.conversation``) arrive at ``rate`` per second and each sends its turns in order,
    a turn after the previous one's answer and an exponential think time of mean ``think_s``.
    No request is sent ``duration_s`` seconds or later after the start; those come back as
    ``sent=False`` records."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode in ("poisson", "multiturn") and (rate is None or rate <= 0):
        raise ValueError(f"poisson mode needs a positive rate, got {rate}")
    records = [RequestRecord(r.prompt_len, r.max_tokens, sent=False) for r in requests]
    done = 0
    to_send = len(requests)

    def finished(i: int, rec: RequestRecord) -> None:
        nonlocal done
        records[i] = rec
        done += 1
        if progress is not None:
            progress(done, to_send)

    async with make_client(timeout_s) as client:
        t0 = time.perf_counter()
        if mode == "single":
            for i, req in enumerate(requests):
                if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                    to_send = i
                    break
                finished(i, await send_request(client, base_url, model, req, timeout_s=timeout_s, t0=t0))
        elif mode == "multiturn":
            await _conversations(client, base_url, model, requests, rate, seed, duration_s, timeout_s,
                                 think_s, t0, finished)
        else:
            arrivals = poisson_arrivals(len(requests), rate, seed)
            if duration_s is not None:
                to_send = sum(1 for a in arrivals if a < duration_s)

            async def one(i: int) -> None:
                finished(i, await send_request(client, base_url, model, requests[i], timeout_s=timeout_s,
                                               t0=t0))

            tasks = []
            for i in range(to_send):
                delay = t0 + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return RunResult(mode, None if mode == "single" else rate, records, wall)


async def _conversations(client: httpx.AsyncClient, base_url: str, model: str, requests: list[Request],
                         rate: float, seed: int, duration_s: float | None, timeout_s: float, think_s: float,
                         t0: float, finished: Callable[[int, RequestRecord], None]) -> None:
    """``run_requests``' multi-turn mode: one task per conversation."""
    convs: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        convs.setdefault(r.conversation, []).append(i)
    arrivals = poisson_arrivals(len(convs), rate, seed)
    rng = np.random.default_rng(seed + 1)
    thinks = {c: rng.exponential(think_s, len(idx)).tolist() if think_s > 0 else [0.0] * len(idx)
              for c, idx in convs.items()}

    async def one(c: int, idx: list[int], arrival: float) -> None:
        await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
        for j, i in enumerate(idx):
            if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                return  # the rest stay unsent
            finished(i, await send_request(client, base_url, model, requests[i], timeout_s=timeout_s, t0=t0))
            if j + 1 < len(idx):
                await asyncio.sleep(thinks[c][j])

    await asyncio.gather(*(one(c, idx, a) for (c, idx), a in zip(convs.items(), arrivals, strict=True)))


async def warm_up(base_url: str, model: str, prompt_ids: list[int], max_tokens: int = 4,
                  timeout_s: float = 600.0) -> RequestRecord:
    """One short request before the timed runs (pages the weights in, starts thread pools)."""
    async with make_client(timeout_s) as client:
        return await send_request(client, base_url, model, Request(prompt_ids, max_tokens),
                                  timeout_s=timeout_s)


def read_metrics(text: str, names: dict[str, str]) -> dict[str, float]:
    """Samples of a Prometheus exposition (``names``: key -> sample name), summed over their
    labels; a sample the text does not hold is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: key for key, name in names.items()}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                key = wanted[sample.name]
                out[key] = out.get(key, 0.0) + sample.value
    return out
