"""A fake OpenAI completions server with known timings, served by uvicorn in a thread.

``POST /v1/completions`` streams one SSE chunk per token: the first after ``first_s``, the
others ``gap_s`` apart, then a usage chunk and ``[DONE]``. The request's ``model`` picks a
misbehaviour: ``bad`` answers HTTP 400, ``drop`` breaks the connection after two tokens,
``nousage`` leaves the usage chunk out.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeState:
    first_s: float = 0.2
    gap_s: float = 0.05
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    served: int = 0  # completions finished
    drafts: bool = False  # /metrics counts 4 draft tokens, 3 accepted, per finished completion


def make_app(state: FakeState) -> Starlette:
    async def health(_: Request):
        return PlainTextResponse("ok")

    async def completions(request: Request):
        body = await request.json()
        state.bodies.append(body)
        if body.get("model") == "bad":
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            state.starts.append(time.perf_counter())
            try:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(state.first_s if i == 0 else state.gap_s)
                    if body.get("model") == "drop" and i == 2:
                        raise ConnectionError("dropped on purpose")
                    chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if body.get("model") != "nousage":
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                state.served += 1  # counted before the client can see the end
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(_: Request):
        n = state.served if state.drafts else 0
        return PlainTextResponse(
            f'sandwich_spec_decode_num_draft_tokens_total{{model="m"}} {4.0 * n}\n'
            f'sandwich_spec_decode_num_accepted_tokens_total{{model="m"}} {3.0 * n}\n'
            f'sandwich_spec_decode_num_drafts_total{{model="m"}} {1.0 * n}\n'
            f'sandwich_spec_decode_draft_seconds_total{{model="m"}} {0.01 * n}\n')

    return Starlette(routes=[Route("/health", health), Route("/metrics", metrics),
                             Route("/v1/completions", completions, methods=["POST"])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """``with FakeServer() as url:`` a running fake server; ``.state`` records what it saw."""

    def __init__(self, state: FakeState | None = None, port: int | None = None):
        self.state = state or FakeState()
        self.port = port or free_port()
        config = uvicorn.Config(make_app(self.state), host="127.0.0.1", port=self.port,
                                log_level="critical", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
