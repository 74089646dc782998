"""Streamed text: detokenized deltas add up to the full decode and never split a character;
stop strings are found across deltas, with nothing of them (or after them) emitted."""

from __future__ import annotations

import pytest

from sandwich_tvm.model.tokenizer import BYTE_OFFSET, load_model_tokenizer
from sandwich_tvm.runtime.text import Detokenizer, StopMatcher

from ..model.hf_models import byte_level_tokenizer

# Bytes of "🦙b 世界": F0 9F A6 99 | 62 | 20 | E4 B8 96 | E7 95 8C; the merges join the llama's
# last byte to "b" and 世's last byte to 界's first, so tokens end inside characters.
MERGES = [(b"\xf0", b"\x9f"), (b"\x99", b"b"), (b"\x96", b"\xe7")]
TEXT = "🦙b 世界 ok"


def stream(tok, ids: list[int]) -> list[str]:
    detok = Detokenizer(tok)
    return [detok.push(t) for t in ids] + [detok.finish()]


def test_deltas_add_up_to_the_decode_without_split_characters():
    tok = byte_level_tokenizer(MERGES)
    ids = tok.encode(TEXT).ids
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # the case we guard
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left for finish


def test_each_complete_character_comes_out_at_once():
    tok = byte_level_tokenizer(MERGES)
    detok = Detokenizer(tok)
    assert [detok.push(t) for t in tok.encode("abc").ids] == ["a", "b", "c"]


def test_finish_flushes_an_incomplete_tail():
    tok = byte_level_tokenizer(MERGES)
    ids = tok.encode("🦙b 世界").ids[:-1]  # 界 lacks its last byte
    deltas = stream(tok, ids)
    assert "".join(deltas[:-1]) == "🦙b " and "".join(deltas) == tok.decode(ids)
    assert deltas[-1].startswith("世")


def test_placeholder_vocabulary_with_bytes_words_and_specials():
    tok = load_model_tokenizer("llama-160m")
    text = "héllo 🦙 世界"
    ids = tok.encode(text)
    assert all(BYTE_OFFSET <= i < BYTE_OFFSET + 256 for i in ids) and len(ids) > len(text)
    mixed = ids[:3] + [300, 2] + ids[3:] + [1234, 2]  # "t300", </s> (skipped), "t1234", </s>
    deltas = stream(tok, mixed)
    assert "".join(deltas) == tok.decode(mixed) == "hét300llo 🦙 世界t1234"
    assert not any("\ufffd" in d for d in deltas)


# --------------------------------------------------------------------------- stop strings


def feed_all(matcher: StopMatcher, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for d in deltas:
        text, stopped = matcher.feed(d)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_split_across_deltas_is_found():
    m = StopMatcher(["STOP"])
    assert m.feed("hello ST") == ("hello ", False)  # "ST" may begin STOP: held back
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.feed("later") == ("", True) and m.flush() == ""


def test_text_before_the_stop_in_the_same_delta_is_emitted():
    assert feed_all(StopMatcher(["STOP"]), ["one ", "two STOP three"]) == ("one two ", True)


def test_a_near_miss_is_released():
    m = StopMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("OX") == ("STOX", False)
    assert feed_all(StopMatcher(["STOP"]), ["x S", "T", "OX", "y"]) == ("x STOXy", False)


def test_a_held_suffix_can_restart_inside_a_near_miss():
    # "SSTOP": the first S is a false start, the match begins at the second.
    assert feed_all(StopMatcher(["STOP"]), ["S", "S", "T", "O", "P"]) == ("S", True)


def test_several_stop_strings_the_earliest_wins():
    assert feed_all(StopMatcher(["END", "\n\n"]), ["a\n", "\nb END"]) == ("a", True)
    assert feed_all(StopMatcher(["END", "\n\n"]), ["a E", "ND\n\n"]) == ("a ", True)
    assert feed_all(StopMatcher(["xyz", "yz!"]), ["axyz!"]) == ("a", True)


def test_flush_returns_the_held_back_text():
    m = StopMatcher(["STOP", "<|end|>"])
    assert m.feed("done <|en") == ("done ", False)
    assert m.flush() == "<|en"
    assert m.flush() == ""


def test_no_stop_strings_pass_through():
    m = StopMatcher([])
    assert m.feed("S") == ("S", False) and m.feed("TOP") == ("TOP", False) and m.flush() == ""
    with pytest.raises(ValueError, match="empty"):
        StopMatcher([""])


def test_detokenized_stream_with_a_stop_string_inside_a_character():
    tok = byte_level_tokenizer(MERGES)
    detok, m = Detokenizer(tok), StopMatcher(["世界"])
    out = []
    for t in tok.encode("🦙b 世界 ok").ids:
        text, stopped = m.feed(detok.push(t))
        out.append(text)
        if stopped:
            break
    assert stopped and "".join(out) == "🦙b "


def test_invalid_bytes_are_not_held_to_the_end():
    """Stray UTF-8 continuation bytes never become a character: the stream must not hold them
    (and everything after them) until the end."""
    tok = load_model_tokenizer("llama-160m")
    detok = Detokenizer(tok)
    stray = [BYTE_OFFSET + 0x80] * 6  # six lone continuation bytes
    deltas = [detok.push(t) for t in stray]
    assert any(deltas[:2]), deltas  # released as soon as a second one shows they are invalid
    assert "".join(deltas) + detok.finish() == tok.decode(stray)


def _byte_fallback_tokenizer():
    """A SentencePiece-style vocabulary (▁ for spaces, <0xNN> byte pieces, a ByteFallback
    decoder: one U+FFFD per byte of an incomplete character), as HF's Llama-2 and our GGUF
    llama vocabularies have."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "▁hi": 1, "▁there": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)} | {"▁": 259}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def test_byte_fallback_characters_come_out_whole():
    tok = _byte_fallback_tokenizer()
    ids = [1, *[3 + b for b in "😀中".encode()], 2]  # ▁hi, 7 byte pieces, ▁there
    assert tok.decode(ids) == "hi😀中 there"
    assert tok.decode(ids[:3]).endswith("\ufffd\ufffd")  # two bytes of 😀: two U+FFFD
    deltas = stream(tok, ids)
    assert "".join(deltas) == "hi😀中 there" and not any("\ufffd" in d for d in deltas)
    assert "😀" in deltas  # whole, the moment its fourth byte arrives


def test_an_invalid_byte_goes_out_with_the_next_word():
    tok = _byte_fallback_tokenizer()
    ids = [1, 3 + 0xFF, 2, 2, 2, 2]  # 0xFF starts no UTF-8 character
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) and "\ufffd" in deltas[2]  # out with the next word


def test_byte_fallback_invalid_bytes_are_not_held_to_the_end():
    tok = _byte_fallback_tokenizer()
    stray = [3 + 0x80] * 6
    detok = Detokenizer(tok)
    deltas = [detok.push(t) for t in stray]
    assert any(deltas[:4]), deltas  # past a character's worth of byte pieces
    assert "".join(deltas) + detok.finish() == tok.decode(stray)


def test_a_leading_space_piece_does_not_count_as_a_byte():
    """``▁`` alone decodes to nothing (stripped at the start), so it waits in the window; the
    emoji's four byte pieces after it still come out whole."""
    tok = _byte_fallback_tokenizer()
    ids = [259, *[3 + b for b in "😀".encode()], 2]  # ▁, the emoji's bytes, ▁there
    assert tok.decode(ids) == "😀 there"
    deltas = stream(tok, ids)
    assert "".join(deltas) == "😀 there" and not any("\ufffd" in d for d in deltas)
