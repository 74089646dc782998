"""Requests: fixed lengths, ShareGPT tokenized with the model's tokenizer, bad input."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.bench.serving.workload import (
    MIN_TOKENS,
    Request,
    TokenLengths,
    fixed_requests,
    parse_lengths,
    sharegpt_requests,
)
from sandwich_tvm.model.tokenizer import BYTE_OFFSET, load_model_tokenizer


def test_fixed_lengths_are_exact_and_seeded():
    reqs = fixed_requests(parse_lengths("512:128,128:64"), 5, vocab_size=32000, seed=3)
    assert [(r.prompt_len, r.max_tokens) for r in reqs] == [(512, 128), (128, 64)] * 2 + [(512, 128)]
    assert all(3 <= i < 32000 for r in reqs for i in r.prompt_ids)
    assert reqs == fixed_requests([(512, 128), (128, 64)], 5, vocab_size=32000, seed=3)
    assert reqs != fixed_requests([(512, 128), (128, 64)], 5, vocab_size=32000, seed=4)


@pytest.mark.parametrize("text", ["", ",", "512", "a:b", "0:5", "5:-1"])
def test_bad_lengths(text):
    with pytest.raises(ValueError, match="--lengths"):
        parse_lengths(text)


def test_request_is_a_value():
    r = Request([1, 2, 3], 4)
    assert r.prompt_ids == (1, 2, 3) and hash(r) == hash(Request((1, 2, 3), 4))
    with pytest.raises(ValueError):
        Request([], 4)


def test_sharegpt_respects_the_context_and_is_seeded():
    tok = load_model_tokenizer("llama-160m")
    reqs = sharegpt_requests(tok, 6, context=256, max_output=32, seed=0)
    assert len(reqs) == 6
    for r in reqs:
        assert r.prompt_len >= MIN_TOKENS and 1 <= r.max_tokens <= 32
        assert r.prompt_len + r.max_tokens <= 256
        assert all(BYTE_OFFSET <= i < BYTE_OFFSET + 256 for i in r.prompt_ids)  # placeholder: bytes
    cache = TokenLengths.for_sharegpt(tok)
    assert cache.path.is_file()
    visited = json.loads(cache.path.read_text())["lengths"]
    assert 6 <= len(visited) < 5000  # tokenized lazily, not the whole dataset
    assert sharegpt_requests(tok, 6, context=256, max_output=32, seed=0) == reqs  # from the cache
    assert sharegpt_requests(tok, 6, context=256, max_output=32, seed=1) != reqs


def test_sharegpt_lengths_are_the_tokenizers():
    tok = load_model_tokenizer("llama-160m")
    turns = [("hi", "hello there"), None, ("a" * 40, "b" * 10), ("c" * 300, "d" * 20), ("e" * 8, "f" * 3)]
    reqs = sharegpt_requests(tok, 10, context=100, seed=0, turns=turns)
    # "hi" is under 4 tokens, None has no gpt turn, 300 + 20 > 100, 3 output tokens < 4
    assert sorted((r.prompt_len, r.max_tokens) for r in reqs) == [(40, 10)]
    assert reqs[0].prompt_ids == tuple(tok.encode("a" * 40))


def _conv(*pairs: tuple[str, str]) -> dict:
    turns = []
    for h, g in pairs:
        turns += [{"from": "human", "value": h}, {"from": "gpt", "value": g}]
    return {"conversations": turns}


def test_conversations_carry_their_history_turn_by_turn():
    from sandwich_tvm.bench.serving.workload import sharegpt_conversations

    tok = load_model_tokenizer("llama-160m")
    convs = [_conv(("hello you", "hi there"), ("how are you", "fine thanks"), ("and now", "bye bye")),
             _conv(("only one turn", "so it is dropped")),
             _conv(("x" * 50, "y" * 20), ("z" * 80, "w" * 40), ("v" * 10, "u" * 10))]
    reqs = sharegpt_conversations(tok, 5, context=200, max_output=16, seed=0, conversations=convs)
    by_conv: dict[int, list[Request]] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation, []).append(r)
    assert sorted(len(v) for v in by_conv.values()) == [2, 3]  # one cut by the context, one dropped
    for turns in by_conv.values():
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.prompt_ids[:before.prompt_len] == before.prompt_ids  # the history leads
            assert after.prompt_len > before.prompt_len
        assert all(r.prompt_len + r.max_tokens <= 200 and r.max_tokens <= 16 for r in turns)
    assert sharegpt_conversations(tok, 5, context=200, seed=0, conversations=convs) != []
