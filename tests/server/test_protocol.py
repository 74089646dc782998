"""Request bodies as OpenAI clients send them: ``null`` for a default, a raw completion prompt
tokenized with its BOS (a chat template writes its own), tool_choice without tools refused."""

from __future__ import annotations

import asyncio

import pytest

from sandwich_tvm.model.tokenizer import ModelTokenizer, placeholder_tokenizer
from sandwich_tvm.server.app import ApiError, Server
from sandwich_tvm.server.protocol import ChatCompletionRequest, CompletionRequest


def test_null_fields_take_their_defaults():
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None, "tool_calls": None}],
        "n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None, "temperature": None,
        "stream_options": {"include_usage": None}, "tools": None, "tool_choice": None})
    assert (chat.n, chat.stream, chat.logprobs, chat.parallel_tool_calls) == (1, False, False, True)
    assert not chat.include_usage and chat.temperature is None and chat.messages[1].content is None
    # a completion's max_tokens: absent is 16 (OpenAI's default), null is up to the context (vLLM)
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None
    with pytest.raises(ValueError) as err:  # a wrong type stays a 400
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "n": "2"})
    assert err.value.errors()[0]["loc"] == ("n",)


def _server() -> Server:
    from tokenizers.processors import TemplateProcessing

    raw = placeholder_tokenizer(400)
    # BOS first and an EOS after, as a GGUF with add_eos_token gives: a prompt keeps only the BOS
    raw.post_processor = TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    server = Server.__new__(Server)  # the request -> tokens half, without an engine
    tok = ModelTokenizer(raw, frozenset({2}), bos_token="<s>")
    server.tok, server.model_name, server.tool_format = tok, "tiny", "generic"
    return server


def test_a_raw_completion_prompt_gets_its_bos():
    server, text = _server(), "Once upon a time"
    ids = asyncio.run(server.completion_prompt(CompletionRequest(prompt=text)))
    assert ids == [1, *server.tok.encode(text)] and ids[1:] != []
    again = asyncio.run(server.completion_prompt(CompletionRequest(prompt="<s>" + text)))
    assert again == ids  # a prompt that starts with BOS's text gets no second one
    assert asyncio.run(server.completion_prompt(CompletionRequest(prompt=[5, 6]))) == [5, 6]  # ids as sent


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_without_tools_is_a_400(choice):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "tool_choice": choice})
    with pytest.raises(ApiError, match="no tools") as err:
        asyncio.run(_server().chat_prompt(req))
    assert err.value.status == 400 and err.value.param == "tool_choice"


def test_logprob_tokens_are_their_own_bytes():
    """A token's logprob entry: its text with SentencePiece's leading space, a lone byte of a
    character as U+FFFD text but its real byte in ``bytes``; completion offsets advance by it."""
    from sandwich_tvm.model.tokenizer import BYTE_OFFSET
    from sandwich_tvm.server.app import _chat_logprobs, _completion_logprobs

    from ..runtime.test_text import _byte_fallback_tokenizer

    spm = ModelTokenizer(_byte_fallback_tokenizer(), frozenset())
    assert [spm.token_bytes(t) for t in (1, 3 + 0xE4, 0)] == [b" hi", b"\xe4", b"<unk>"]
    byte_level = _server().tok  # GPT-2's byte map: the placeholder's byte tokens
    assert byte_level.token_bytes(BYTE_OFFSET + 0xE4) == b"\xe4" and byte_level.token_bytes(300) == b"t300"
    server = _server()
    pieces = [server._piece(t) for t in (300, BYTE_OFFSET + 0xE4, BYTE_OFFSET + ord(" "))]
    assert pieces == [("t300", b"t300"), ("\ufffd", b"\xe4"), (" ", b" ")]
    entries = [{"token": p, "logprob": -1.0, "top": [(p, 0, -1.0)]} for p in pieces]
    assert _completion_logprobs(entries, 10)["text_offset"] == [10, 14, 15]
    assert _chat_logprobs(entries)["content"][1]["bytes"] == [0xE4]
