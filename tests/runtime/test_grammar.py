"""Grammars and the request side of structured output, without a model: masks that only allow
what the grammar allows, and the tool format's schema, prompt and parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sandwich_tvm.model.tokenizer import placeholder_tokenizer
from sandwich_tvm.runtime.grammar import GrammarError, Grammars, grammar_from_choice, grammar_from_json_schema
from sandwich_tvm.server.protocol import ChatCompletionRequest
from sandwich_tvm.server.structured import chat_messages, output_grammar, parse_tool_output, tool_schema

jsonschema = pytest.importorskip("jsonschema")
VOCAB = 400
SCHEMA = {"type": "object", "required": ["n", "c"], "additionalProperties": False,
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "c": {"enum": ["x", "yz"]}}}


@pytest.fixture(scope="module")
def grammars():
    tok = placeholder_tokenizer(VOCAB)
    return Grammars(tok, VOCAB, [2]), tok


def _walk(grammars, grammar: str, seed: int) -> str:
    """Sample uniformly among the allowed tokens until the grammar completes."""
    g, tok = grammars
    c = g.constraint(grammar)
    rng, out = np.random.default_rng(seed), []
    for _ in range(200):
        logits = np.zeros(VOCAB, np.float32)
        c.mask(logits)
        token = int(rng.choice(np.flatnonzero(np.isfinite(logits))))
        if token == 2:
            break
        out.append(token)
        c.accept(token)
        if c.done:
            break
    assert c.error is None
    return tok.decode(out)


def test_random_walks_under_a_schema_always_validate(grammars):
    grammar = grammar_from_json_schema(SCHEMA)
    texts = {_walk(grammars, grammar, seed) for seed in range(20)}
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert ": " not in text or '": ' in text  # compact separators only, no free whitespace
    assert len(texts) > 3
    assert {_walk(grammars, grammar_from_choice(["yes", "no"]), s) for s in range(10)} == {"yes", "no"}


def test_bad_grammars_name_the_problem(grammars):
    g, _ = grammars
    with pytest.raises(GrammarError, match="objekt"):
        g.constraint(grammar_from_json_schema({"type": "objekt"}))
    with pytest.raises(GrammarError, match="not a JSON object"):
        grammar_from_json_schema("[1, 2")
    with pytest.raises(GrammarError, match="non-empty"):
        grammar_from_choice([])


def _chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]} | body)


TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def test_output_constraints_one_at_a_time():
    assert output_grammar(_chat()) is None
    assert output_grammar(_chat(response_format={"type": "text"})) is None
    assert output_grammar(_chat(response_format={"type": "json_object"}))[1] == "response_format"
    with pytest.raises(GrammarError, match="one output constraint"):
        output_grammar(_chat(guided_regex="a", guided_choice=["b"]))


def test_the_tool_schema_follows_tool_choice():
    auto = tool_schema(_chat(tools=[TOOL]))
    call = {"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}
    jsonschema.validate(call, auto)
    jsonschema.validate({"response": "hello"}, auto)
    required = tool_schema(_chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False))
    jsonschema.validate(call, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "hello"}, required)
    with pytest.raises(jsonschema.ValidationError):  # one call only
        jsonschema.validate({"tool_calls": call["tool_calls"] * 2}, required)
    with pytest.raises(GrammarError, match="nope"):
        tool_schema(_chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}))


def test_tool_history_renders_in_the_generic_format():
    req = _chat(tools=[TOOL], messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}])
    msgs = chat_messages(req)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("be brief")
    assert '"add"' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}
    assert msgs[3] == {"role": "user", "content": json.dumps({"tool_response": {"tool_call_id": "call_1",
                                                                                "content": "2"}})}
    assert "add" not in chat_messages(_chat(tools=[TOOL], tool_choice="none"))[0]["content"]


def test_parse_tool_output():
    content, calls = parse_tool_output('{"tool_calls": [{"name": "add", "arguments": {"a": 3}}]}')
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 3}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert parse_tool_output('{"response": "hi"}') == ("hi", [])
    assert parse_tool_output('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])  # cut short


def test_a_failed_matcher_ends_the_sequence_as_an_error():
    """llguidance reports stopped in its error state too: a parser failure is an error, not a
    complete output."""
    from types import SimpleNamespace

    from sandwich_tvm.runtime.grammar import grammar_ending

    assert grammar_ending(SimpleNamespace(error=None, done=False)) is None
    assert grammar_ending(SimpleNamespace(error=None, done=True)) == ("stop", None)
    reason, why = grammar_ending(SimpleNamespace(error="max_items exceeded", done=True))
    assert reason == "error" and "max_items exceeded" in why
