"""Structured output and tool calls through real HTTP clients, and the requests that must be a
clear 400: a bogus response_format, an invalid schema, an unknown role, unpaired surrogates."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import httpx
import pytest

from .conftest import MODEL

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.compile

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)


def _post(served, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/{route}", json={"model": MODEL} | body, timeout=120)


def _metric_sum(served, name: str) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_fifty_json_schema_requests_all_parse_and_validate(served):
    client = _client(served)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    masks_before = _metric_sum(served, "sandwich_grammar_mask_seconds_count")

    def ask(i: int) -> str:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"person number {i}"}], max_tokens=80,
            temperature=1.0, seed=i, response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].message.content

    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(50)))
    for text in answers:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(answers)) > 1  # sampled, not one fixed answer
    # the masks' time is measured per step
    assert _metric_sum(served, "sandwich_grammar_mask_seconds_count") > masks_before


def test_json_object_regex_choice_and_grammar(served):
    r = _post(served, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 150,
                                           "response_format": {"type": "json_object"}, "seed": 1})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = _post(served, "completions", {"prompt": "a", "max_tokens": 20, "guided_regex": "[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", r.json()["choices"][0]["text"])
    r = _post(served, "completions", {"prompt": "a", "max_tokens": 20, "guided_choice": ["yes", "no"]})
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    r = _post(served, "completions", {"prompt": "a", "max_tokens": 20,
                                      "guided_grammar": 'start: "(" NUM ")"\nNUM: /[1-9]/'})
    assert re.fullmatch(r"\([1-9]\)", r.json()["choices"][0]["text"])


def test_streamed_json_is_the_same_json(served):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    whole = _post(served, "chat/completions", body).json()["choices"][0]["message"]["content"]
    chunks = list(_client(served).chat.completions.create(model=MODEL, stream=True, **body))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_tool_calls_round_trip_through_the_openai_client(served):
    client = _client(served)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                           tool_choice="required", max_tokens=150, temperature=0,
                                           parallel_tool_calls=False)  # a random model calls on and on
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the call and its result go back; the model answers (free text: tool_choice none)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=5, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "length"
    # streamed: the call's head (id, name) once, then its arguments in pieces as they are
    # generated, which join into the same JSON; through the client's stream parser
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER],
                                                 tool_choice={"type": "function",
                                                              "function": {"name": "get_weather"}},
                                                 max_tokens=150, temperature=0, stream=True,
                                                 parallel_tool_calls=False, logprobs=True,
                                                 stream_options={"include_usage": True}))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # every token's logprob arrives once, those of tokens that made no delta with the next one
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == [c for c in chunks if c.usage][-1].usage.completion_tokens
    heads = [c for c in calls if c.id]
    assert [(c.index, c.function.name, c.type) for c in heads] == [(0, "get_weather", "function")]
    assert heads[0].id.startswith("call_") and calls[0] is heads[0]
    pieces = [c.function.arguments for c in calls[1:]]
    assert len(pieces) > 1 and all(c.index == 0 and c.function.name is None for c in calls[1:])
    assert json.loads("".join(pieces)) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_tool_choice_answers_with_a_call_or_text(served):
    r = _post(served, "chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                           "max_tokens": 150, "tools": [WEATHER], "temperature": 0,
                                           "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    msg, reason = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
    if msg.get("tool_calls"):
        assert reason == "tool_calls" and msg["content"] is None
    else:  # a direct answer: the "response" string, not the JSON around it
        assert reason in ("stop", "length") and isinstance(msg["content"], str)


@pytest.mark.parametrize("body, where, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "one output constraint"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "assistant"),
    ({"messages": [{"role": "user", "content": "bad \ud800 text"}]}, "messages", "surrogate"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool", "nope"),
])
def test_bad_requests_are_a_clear_400(served, body, where, words):
    full = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body
    r = httpx.post(f"{served.url}/v1/chat/completions", content=json.dumps({"model": MODEL} | full),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert where in (err["param"] or "") + err["message"] and words in err["message"]


def test_a_completion_prompt_with_a_lone_surrogate_is_a_400(served):
    r = httpx.post(f"{served.url}/v1/completions", content='{"prompt": "x \\udc00", "max_tokens": 2}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]



@pytest.fixture(scope="module")
def hermes(served):
    """The same engine behind a second app whose tokenizer has a Hermes tool template."""
    import dataclasses
    from pathlib import Path

    from sandwich_tvm.runtime.metrics import ServingMetrics
    from sandwich_tvm.server.app import Server, create_app

    from .conftest import start_app

    template = (Path(__file__).parents[1] / "fixtures" / "hermes_template.jinja").read_text()
    tok = dataclasses.replace(served.tok, chat_template=template)
    metrics = ServingMetrics(MODEL + "-hermes")
    url, stop = start_app(create_app(Server(served.async_engine, tok, MODEL, metrics)))
    yield type("Url", (), {"url": url})()
    stop()


def test_a_hermes_template_gets_its_own_tool_format_through_the_openai_client(hermes):
    """The template lists the tools and renders the history; the answer is constrained to its
    <tool_call> blocks, comes back as OpenAI tool_calls, and streams as heads and pieces."""
    client = _client(hermes)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                           tool_choice="required", max_tokens=120, temperature=0,
                                           parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=5, temperature=0)
    assert second.choices[0].message.tool_calls is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER],
                                                 tool_choice="required", max_tokens=120, temperature=0,
                                                 stream=True, parallel_tool_calls=False))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls if c.id] == ["get_weather"]
    assert json.loads("".join(c.function.arguments for c in calls)) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
