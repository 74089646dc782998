"""The chat template's own tool format (Hermes ``<tool_call>`` blocks) where it has one: found in
the template, the tools and the tool history rendered by the template exactly as HF's
``apply_chat_template`` renders them, answers parsed and streamed; the generic format elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandwich_tvm.model.tokenizer import DEFAULT_CHAT_TEMPLATE, ModelTokenizer, placeholder_tokenizer
from sandwich_tvm.server.protocol import ChatCompletionRequest
from sandwich_tvm.server.structured import (
    GENERIC,
    HERMES,
    chat_messages,
    parse_tool_output,
    template_tools,
    tool_format,
    tool_grammar,
)
from sandwich_tvm.server.tool_stream import ToolCallStream

HERMES_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "hermes_template.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": [WEATHER]} | kw)


def test_the_format_is_the_templates_own_where_it_has_one():
    assert tool_format(HERMES_TEMPLATE) == HERMES
    assert tool_format(DEFAULT_CHAT_TEMPLATE) == GENERIC and tool_format(None) == GENERIC


def test_tools_and_history_render_as_hfs_apply_chat_template():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=placeholder_tokenizer(512))
    hf.chat_template = HERMES_TEMPLATE
    ours = ModelTokenizer(tok=None, eos_ids=frozenset(), chat_template=HERMES_TEMPLATE)
    req = _req()
    got = ours.render_chat(chat_messages(req, HERMES), True, template_tools(req))
    native_calls = [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    history = [m | {"tool_calls": native_calls} if m.get("tool_calls") else m for m in HISTORY]
    want = hf.apply_chat_template(history, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert got == want
    assert "<tools>" in got and "Weather <now> & later" in got  # HF's tojson: no HTML escapes
    assert '<tool_response>\n21 C\n</tool_response>' in got


def test_hermes_answers_parse_into_calls_or_content():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    content, calls = parse_tool_output(text, HERMES)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"}, {"city": "Rome"}]
    assert parse_tool_output("It is sunny.", HERMES) == ("It is sunny.", [])
    cut = '<tool_call>\n{"name": "get_wea'
    assert parse_tool_output(cut, HERMES) == (cut, [])


def test_hermes_answers_stream_as_calls_or_as_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    st, deltas = ToolCallStream(HERMES), []
    for i in range(len(text) + 1):
        deltas += st.feed(text[:i])
    calls = [d["tool_calls"][0] for d in deltas]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["index"] == 0
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    st, deltas = ToolCallStream(HERMES), []
    for i in range(len("Sunny <b>")):
        deltas += st.feed("Sunny <b>"[:i + 1])
    assert "".join(d["content"] for d in deltas) == "Sunny <b>"


def test_hermes_grammars_compile_for_every_tool_choice():
    from llguidance import LLMatcher

    for kw in ({}, {"tool_choice": "required"}, {"parallel_tool_calls": False},
               {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
        assert LLMatcher.validate_grammar(tool_grammar(_req(**kw), HERMES)) == ""


@pytest.mark.parametrize("cut", ['{"response": "Hello \\u00e9 wor', '{"response": "Hello \\', '{"resp'])
def test_a_direct_answer_cut_short_is_the_text_a_stream_sent(cut):
    """max_tokens cut the generic format's answer: the non-streamed content is what the stream
    sent (the string's text so far), not the JSON around it; text that is not an answer stays."""
    stream = ToolCallStream(GENERIC)
    sent = "".join(d.get("content", "") for i in range(len(cut) + 1) for d in stream.feed(cut[:i]))
    content, calls = parse_tool_output(cut, GENERIC)
    assert calls == [] and content == (sent if cut.startswith('{"response": ') else cut)
    assert content != cut or cut == '{"resp'



def test_a_closing_tag_inside_an_argument_is_text():
    """``</tool_call>`` (or ``<tool_call>``) inside an argument string does not end the call,
    whole or streamed."""
    args = {"note": 'a</tool_call>b <tool_call> c "q" {'}
    rome = {"city": "Rome"}
    text = "\n".join(f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': a})}\n</tool_call>"
                     for a in (args, rome))
    content, calls = parse_tool_output(text, HERMES)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [args, rome]
    st, deltas = ToolCallStream(HERMES), []
    for i in range(len(text) + 1):
        deltas += st.feed(text[:i])
    by_index: dict[int, str] = {}
    for d in deltas:
        call = d["tool_calls"][0]
        by_index[call["index"]] = by_index.get(call["index"], "") + call["function"]["arguments"]
    assert [json.loads(v) for _, v in sorted(by_index.items())] == [args, rome]


def test_a_hermes_answer_cut_short_keeps_its_closed_calls():
    """max_tokens ending inside a third call: the two closed calls, as a stream sent them."""
    calls = [{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Rome")]
    text = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls) + '\n<tool_call>\n{"na'
    content, got = parse_tool_output(text, HERMES)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in got] == [
        {"city": "Paris"}, {"city": "Rome"}]
