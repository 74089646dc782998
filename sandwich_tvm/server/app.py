"""The OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming
or one JSON body), ``/v1/models``, ``/health`` and ``/metrics``.

Each request is tokenized on the event loop's side (in a worker thread), handed to the
``AsyncEngine``, and its tokens are turned back into text with an incremental detokenizer and
a stop-string matcher. A client that disconnects cancels its sequence (its KV pages are freed
at the next iteration).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..model.tokenizer import ChatTemplateError, ModelTokenizer
from ..runtime.async_engine import AsyncEngine, EngineDead
from ..runtime.batch import TokenEvent
from ..runtime.engine import EngineError
from ..runtime.grammar import Constraint, GrammarError, Grammars
from ..runtime.metrics import ServingMetrics
from ..runtime.sampling import SamplingError, SamplingParams
from ..runtime.scheduler import QueueFull
from ..runtime.text import Detokenizer, StopMatcher
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from .structured import (
    HERMES,
    chat_messages,
    output_grammar,
    parse_tool_output,
    template_tools,
    tool_format,
    tool_grammar,
    tools_active,
)
from .tool_stream import ToolCallStream

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An HTTP error in OpenAI's shape (``response()``)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.status),
                            status_code=self.status, headers=self.headers)


@dataclass
class Completion:
    """What one request produced so far, as text."""

    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)


class Server:
    """Routes over one engine, tokenizer and served model name."""

    def __init__(self, engine: AsyncEngine, tok: ModelTokenizer | None, model_name: str,
                 metrics: ServingMetrics | None = None):
        self.engine, self.tok, self.model_name, self.metrics = engine, tok, model_name, metrics
        self.tool_format = tool_format(tok.chat_template if tok is not None else None)
        self.context = engine.batch.engine.context
        self.vocab_size = engine.batch.engine.cfg.vocab_size
        self.grammars = Grammars(tok.tok, self.vocab_size, tok.eos_ids) if tok is not None else None

    # ------------------------------------------------------------------ request → tokens
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model", "not_found_error")

    def _check_common(self, req) -> None:
        self.check_model(req.model)
        if req.n != 1:
            raise ApiError(400, f"n={req.n}: this server returns one choice per request", "n")

    async def encode(self, text: str, where: str = "prompt", raw_prompt: bool = False) -> list[int]:
        """Token ids of ``text``; a raw completion prompt gets the tokenizer's BOS (as vLLM and
        llama-server give it, ``ModelTokenizer.prompt_ids``), a rendered chat template has its own."""
        if self.tok is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids")
        _check_unicode(text, where)
        return await asyncio.to_thread(self.tok.prompt_ids if raw_prompt else self.tok.encode, text)

    async def completion_prompt(self, req: CompletionRequest) -> list[int]:
        self._check_common(req)
        if req.echo or req.suffix:
            raise ApiError(400, "echo and suffix are not supported", "echo" if req.echo else "suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"{len(prompt)} prompts in one request: send one prompt per request",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.encode(prompt, raw_prompt=True)
        return list(prompt)

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        self._check_common(req)
        if req.tool_choice not in (None, "none", "auto") and not req.tools:
            raise ApiError(400, "tool_choice asks for a tool call, but the request has no tools",
                           "tool_choice")
        if self.tok is None:
            raise ApiError(400, "this model has no tokenizer, so it has no chat template; use "
                                "/v1/completions with token ids")
        try:
            messages = chat_messages(req, self.tool_format)
            tools = template_tools(req) if self.tool_format == HERMES else None
        except GrammarError as err:
            raise ApiError(400, str(err), "tool_choice" if req.tools else "messages") from err
        for i, m in enumerate(messages):
            _check_unicode(m["content"], f"messages[{i}].content")
        try:
            text = await asyncio.to_thread(self.tok.render_chat, messages, req.add_generation_prompt, tools)
        except ChatTemplateError as err:
            raise ApiError(400, str(err), "messages") from err
        return await self.encode(text, "messages")

    async def constraint(self, req, chat: bool) -> Constraint | None:
        """The request's output grammar, compiled (``ApiError`` 400 naming what is wrong)."""
        where = "tools"
        try:
            if chat and tools_active(req):
                if output_grammar(req) is not None:
                    raise GrammarError("tools and an output constraint (response_format, guided_*) "
                                       "cannot be combined")
                grammar = tool_grammar(req, self.tool_format)
            else:
                found = output_grammar(req)
                if found is None:
                    return None
                grammar, where = found
            if self.grammars is None:
                raise GrammarError("this model has no tokenizer, so its output cannot be constrained")
            return await asyncio.to_thread(self.grammars.constraint, grammar)
        except GrammarError as err:
            raise ApiError(400, f"{where}: {err}", where) from err

    # ------------------------------------------------------------------ tokens → text
    async def run(self, request: Request, rid: str, prompt: list[int], params: SamplingParams,
                  want_logprobs: bool, constraint: Constraint | None = None
                  ) -> AsyncIterator[tuple[str, Completion, list[dict]]]:
        """(text delta, totals so far, logprob entries of this delta) per engine event of request
        ``rid``; raises ``ApiError`` for requests the engine refuses."""
        arrival = time.perf_counter()
        detok = Detokenizer(self.tok) if self.tok is not None else None
        stops = StopMatcher(params.stop)
        done = Completion(prompt_tokens=len(prompt))
        watcher = asyncio.create_task(self._watch(request, rid))
        events = _first_checked(self.engine.generate(rid, prompt, params, arrival, constraint))
        try:
            async for event in events:
                delta, entries = self._text_of(event, detok, want_logprobs)
                done.tokens, done.cached_tokens = event.output_tokens, event.cached_tokens
                if event.finish_reason == "error":
                    raise ApiError(500, f"generation failed: {event.error}")
                if event.finish_reason is not None and detok is not None:
                    delta += detok.finish()
                safe, stopped = stops.feed(delta)
                if not stopped and event.finish_reason is not None:
                    safe += stops.flush()
                done.text += safe
                done.logprobs += entries
                if stopped or event.finish_reason is not None:
                    done.finish_reason = "stop" if stopped else event.finish_reason
                yield safe, done, entries
                if done.finish_reason is not None:
                    return
        finally:
            # abort first: under a cancelled task (a client gone mid-stream) every await raises
            self.engine.abort(rid)  # a no-op once finished; cancels a stop-string hit or a gone client
            watcher.cancel()
            await events.aclose()

    async def _watch(self, request: Request, rid: str) -> None:
        """Cancel the sequence when the client goes away (non-streaming requests too)."""
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)
        self.engine.abort(rid)

    def _text_of(self, event: TokenEvent, detok: Detokenizer | None,
                 want_logprobs: bool) -> tuple[str, list[dict]]:
        if event.token is None or event.stop_token:
            return "", []
        delta = detok.push(event.token) if detok else ""
        entries = []
        if want_logprobs and event.sample is not None and event.sample.logprob is not None:
            entries.append({"token": self._piece(event.token), "id": event.token,
                            "logprob": event.sample.logprob,
                            "top": [(self._piece(t), t, lp) for t, lp in event.sample.top_logprobs or []]})
        return delta, entries

    def _piece(self, token: int) -> tuple[str, bytes]:
        """A token's text out of context and its bytes (a lone byte of a character: U+FFFD as
        text, the byte itself in ``bytes``)."""
        if self.tok is None:
            return str(token), str(token).encode()
        raw = self.tok.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw


async def _first_checked(events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
    """``events`` with the engine's refusals (raised before the first event) as ``ApiError``."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        return
    except EngineError as err:
        raise ApiError(400, str(err), "prompt") from err
    except QueueFull as err:
        raise ApiError(429, f"the server is overloaded: {err}", kind="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from err
    except EngineDead as err:
        raise ApiError(503, str(err), headers={"Retry-After": str(RETRY_AFTER_S)}) from err
    if first.finish_reason == "error" and first.token is None and first.output_tokens == 0:
        await events.aclose()
        raise ApiError(503, f"the request was not scheduled: {first.error}",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    try:
        yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


def _check_unicode(text: str, where: str) -> None:
    """A 400 for text that UTF-8 cannot hold (JSON's unpaired UTF-16 surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{where} holds an unpaired UTF-16 surrogate ({text[err.start]!r} at character "
                            f"{err.start}); send valid Unicode", where) from err


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.tokens,
            "total_tokens": c.prompt_tokens + c.tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def _finish(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason) if reason else None


def _completion_logprobs(entries: list[dict], offset: int) -> dict:
    """OpenAI's completion logprobs; ``text_offset``: each token's position in the text, from
    ``offset`` (where these entries' text starts)."""
    starts = []
    for e in entries:
        starts.append(offset)
        offset += len(e["token"][0])
    return {"tokens": [e["token"][0] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t[0]: lp for t, _, lp in e["top"]} for e in entries], "text_offset": starts}


def _chat_logprobs(entries: list[dict]) -> dict:
    def item(token: tuple[str, bytes], lp: float) -> dict:
        return {"token": token[0], "logprob": lp, "bytes": list(token[1])}

    return {"content": [item(e["token"], e["logprob"])
                        | {"top_logprobs": [item(t, lp) for t, _, lp in e["top"]]} for e in entries]}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def create_app(server: Server) -> FastAPI:
    """The FastAPI application; ``server.engine`` must be started."""
    app = FastAPI(title="sandwich-tvm", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return ApiError(400, f"the body is not valid JSON: {first.get('msg', '')}").response()
        return ApiError(400, f"{where or 'body'}: {first.get('msg', 'invalid')}", where or None).response()

    @app.exception_handler(ApiError)
    async def _api(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.alive:
            return ApiError(503, server.engine.dead or "the engine is not running").response()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "sandwich-tvm", "max_model_len": server.context}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if server.metrics is None:
            return ApiError(404, "metrics are off").response()
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def params_of(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            params = req.sampling(max_tokens, logprobs)
        except SamplingError as err:
            raise ApiError(400, str(err)) from err
        vocab = server.vocab_size
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            raise ApiError(400, f"logit_bias names token ids {outside[:5]} outside the vocabulary "
                                f"(size {vocab})", "logit_bias")
        return params

    async def respond(request: Request, req, prompt: list[int], params: SamplingParams, chat: bool):
        want_lp = params.logprobs is not None
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, obj = int(time.time()), "chat.completion" if chat else "text_completion"
        rid = uuid.uuid4().hex
        constraint = await server.constraint(req, chat)
        tool_mode = chat and tools_active(req)  # the output is the tool JSON: parsed (streamed: as it grows)
        events = server.run(request, rid, prompt, params, want_lp, constraint)
        try:  # refusals surface before the first event: answer them as errors, not as a stream
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None

        def choice(text: str, done: Completion, entries: list[dict], final: bool) -> dict:
            reason = _finish(done.finish_reason) if final else None
            if chat:
                msg: dict = {"content": text}
                if tool_mode:  # the whole answer, parsed: text or tool calls (streams: tool_chunks)
                    content, calls = parse_tool_output(done.text, server.tool_format) if final else (None, [])
                    msg = {"content": content}
                    if calls:
                        msg["tool_calls"] = calls
                        reason = "tool_calls" if reason == "stop" else reason
                if not req.stream:
                    msg = {"role": "assistant"} | msg
                return {"index": 0, "delta" if req.stream else "message": msg,
                        "logprobs": _chat_logprobs(entries) if want_lp else None, "finish_reason": reason}
            offset = len(done.text) - len(text)
            return {"index": 0, "text": text, "finish_reason": reason,
                    "logprobs": _completion_logprobs(entries, offset) if want_lp else None}

        head = {"id": cid, "created": created, "model": server.model_name}
        if not req.stream:
            done = first[1] if first else Completion(prompt_tokens=len(prompt))
            async for item in events:
                done = item[1]
            return JSONResponse(head | {"object": obj, "choices": [choice(done.text, done, done.logprobs,
                                                                            True)],
                                        "usage": _usage(done)})

        tools = ToolCallStream(server.tool_format)
        unsent: list[dict] = []  # logprobs of tokens whose text made no delta yet

        def tool_chunks(stream_: ToolCallStream, done: Completion, entries: list[dict], final: bool):
            deltas = stream_.feed(done.text)
            unsent.extend(entries)
            for i, delta in enumerate(deltas):
                lp = None
                if want_lp and i == len(deltas) - 1:  # every token so far rides on the step's last delta
                    lp = _chat_logprobs(list(unsent))
                    unsent.clear()
                yield {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}
            if final:
                reason = _finish(done.finish_reason)
                reason = "tool_calls" if stream_.called and reason == "stop" else reason
                lp = _chat_logprobs(list(unsent)) if want_lp and unsent else None
                unsent.clear()
                yield {"index": 0, "delta": {}, "logprobs": lp, "finish_reason": reason}

        async def stream() -> AsyncIterator[str]:
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            done = Completion(prompt_tokens=len(prompt))
            try:
                if chat:
                    yield _sse(head | {"object": chunk_obj, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
                pending = [first] if first else []
                while True:
                    item = pending.pop() if pending else await events.__anext__()
                    text, done, entries = item
                    final = done.finish_reason is not None
                    if tool_mode:  # the calls' heads and arguments (or the answer) as they grow
                        for chunk in tool_chunks(tools, done, entries, final):
                            yield _sse(head | {"object": chunk_obj, "choices": [chunk]})
                        if final:
                            break
                        continue
                    if text or entries or final:
                        c = choice(text, done, entries, final)
                        if chat and final and not text and not tool_mode:
                            c["delta"] = {}
                        yield _sse(head | {"object": chunk_obj, "choices": [c]})
                    if final:
                        break
            except StopAsyncIteration:
                pass
            except ApiError as err:  # failed mid-stream: the error as the last event
                yield _sse(error_body(err.message, err.kind, err.param, err.status))
            finally:
                server.engine.abort(rid)  # synchronous: runs even when the client's task is cancelled
                await events.aclose()
            if req.include_usage:
                yield _sse(head | {"object": chunk_obj, "choices": [], "usage": _usage(done)})
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        """The ids a completion or chat request with this prompt would be served (vLLM's form)."""
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send either prompt (a completion's) or messages (a chat's)", "prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(model=req.model, messages=req.messages, tools=req.tools,
                                         add_generation_prompt=req.add_generation_prompt)
            ids = await server.chat_prompt(chat)
        else:
            server.check_model(req.model)
            ids = await server.encode(req.prompt, raw_prompt=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.context, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        server.check_model(req.model)
        if server.tok is None:
            raise ApiError(400, "this model has no tokenizer: its ids have no text")
        vocab = server.vocab_size
        outside = [t for t in req.tokens if not 0 <= t < vocab]
        if outside:
            raise ApiError(400, f"tokens {outside[:5]} are outside the vocabulary (size {vocab})", "tokens")
        # special tokens kept: the text /tokenize gave these ids for
        return {"prompt": await asyncio.to_thread(server.tok.decode, req.tokens, False)}

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        prompt = await server.completion_prompt(req)
        params = params_of(req, req.max_tokens, req.logprobs)
        return await respond(request, req, prompt, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest):
        prompt = await server.chat_prompt(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = params_of(req, max_tokens, logprobs)
        return await respond(request, req, prompt, params, chat=True)

    return app
