"""Tool calls streamed as they grow: a call's head once its name is whole, then its arguments'
JSON text in pieces that join into what the model wrote; a direct answer as decoded content;
every prefix of the output, however it is cut, gives only deltas that stay true."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.server.tool_stream import ToolCallStream, scan

CALLS = ('{ "tool_calls" : [ {"name": "get_weather", "arguments": {"city": "Pa\\"ris \\u00e9", '
         '"days": [1, 2], "x": {"y": null}}}, {"name": "add", "arguments": {"a": 1.5}} ] }')


def _stream(text: str) -> list[dict]:
    st, out = ToolCallStream(), []
    for i in range(len(text) + 1):  # one character at a time: every cut a token could make
        out += st.feed(text[:i])
    return out


def test_calls_stream_as_heads_then_argument_pieces_that_join_into_the_json():
    deltas = _stream(CALLS)
    calls = [d["tool_calls"][0] for d in deltas]
    heads = [c for c in calls if "id" in c]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in heads] == [
        (0, "get_weather", ""), (1, "add", "")]
    assert len({c["id"] for c in heads}) == 2 and all(c["id"].startswith("call_") for c in heads)
    joined = {}
    for c in calls:
        joined[c["index"]] = joined.get(c["index"], "") + c["function"]["arguments"]
    want = json.loads(CALLS)["tool_calls"]
    assert [json.loads(joined[i]) for i in (0, 1)] == [w["arguments"] for w in want]
    # a call's head comes before any of its arguments, and call 1 starts after call 0 ends
    order = [(c["index"], "id" in c) for c in calls]
    assert order.index((1, True)) > max(i for i, (idx, _) in enumerate(order) if idx == 0)


def test_a_direct_answer_streams_as_decoded_content():
    text = '{"response": "he said \\"hi\\", \\u00e9t\\u00e9 \\\\ done\\n \\ud83d\\ude00!"}'
    pieces = [d["content"] for d in _stream(text)]
    assert len(pieces) > 5 and "".join(pieces) == json.loads(text)["response"]
    assert all("tool_calls" not in d for d in _stream(text))


@pytest.mark.parametrize("prefix, kind, names", [
    ("", None, []), ('{"tool_ca', None, []), ('{"tool_calls": [', "tool_calls", []),
    ('{"tool_calls": [{"name": "get_w', "tool_calls", [None]),
    ('{"tool_calls": [{"name": "get_weather", "argu', "tool_calls", ["get_weather"]),
    ('{"response": "a\\u00', "response", []),
])
def test_scan_reads_a_prefix_cut_anywhere(prefix, kind, names):
    got = scan(prefix)
    assert got.kind == kind and [c.name for c in got.calls] == names
    if kind == "response":
        assert got.content == "a"  # the escape that has not arrived whole is held back


@pytest.mark.parametrize("seed", range(5))
def test_what_was_streamed_is_what_a_fresh_scan_reads_at_every_cut(seed):
    """The stream reads only what is new on each feed; at any cut, however the tokens fall, the
    arguments and content sent so far are exactly what ``scan`` reads from the prefix."""
    import random

    rng = random.Random(seed)
    answer = ('{"response": "x \\u00e9 \\ud83d\\ude00 \\"q\\" ' + "ab " * rng.randint(0, 40) + '"}')
    piece = 'a\\"b{['  # quotes, a backslash and brackets inside one long string
    long_string = json.dumps({"tool_calls": [{"name": "f", "arguments": {"s": piece * rng.randint(5, 60)}}]})
    for text in (CALLS, answer, long_string):
        st, cut, args, content = ToolCallStream(), 0, {}, ""
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 7))
            for d in st.feed(text[:cut]):
                content += d.get("content", "")
                for c in d.get("tool_calls", []):
                    args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
            now = scan(text[:cut])
            assert content == now.content
            assert args == {i: c.arguments for i, c in enumerate(now.calls) if c.name is not None}
