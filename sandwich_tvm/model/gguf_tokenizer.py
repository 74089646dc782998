"""A GGUF's tokenizer: a ``tokenizers.Tokenizer`` rebuilt from llama.cpp's ``tokenizer.ggml.*``
metadata, with its BOS/EOS ids and ``tokenizer.chat_template``.

Two vocabularies, as llama.cpp names them:

- ``gpt2``: byte-level BPE (SmolLM2, Llama 3) from the vocabulary and merges, split before BPE
  as the model's own ``tokenizer.json`` does (``tokenizer.ggml.pre``: ``smollm`` splits digits
  first, the Llama-3 family by its regex, everything else by GPT-2's);
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, TinyLlama), as HF's
  ``LlamaTokenizer`` builds it; the merges are recovered from the token scores when the file
  has none.

Control tokens (type 3) are special tokens, user-defined ones (type 4) plain added tokens, both
matched whole.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import ModelLoadError
from .gguf import metadata, open_gguf
from .tokenizer import DEFAULT_CHAT_TEMPLATE, ModelTokenizer, byte_chars

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre values of the Llama-3 split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3 and kin)
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral", "lfm2")
GPT2_PRE = ("default", "gpt-2", "gpt2", "smollm")


def gguf_model_tokenizer(path: Path) -> ModelTokenizer:
    """The tokenizer a GGUF's metadata describes; a GGUF without one is a ``ModelLoadError``."""
    reader = open_gguf(path)
    kind = metadata(reader, "tokenizer.ggml.model")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ModelLoadError(f"{path} has no tokenizer (no tokenizer.ggml.model/tokens metadata); use a GGUF "
                             "converted with its tokenizer")
    types = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = metadata(reader, "tokenizer.ggml.merges")
    if kind == "gpt2":
        tok = byte_level_bpe(tokens, merges or [], metadata(reader, "tokenizer.ggml.pre", "default"), path)
    elif kind == "llama":
        scores = metadata(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True)
        tok = sentencepiece_bpe(tokens, scores, merges, prefix,
                                unk_id=metadata(reader, "tokenizer.ggml.unknown_token_id"))
    else:
        raise ModelLoadError(f"{path}: tokenizer {kind!r} is not supported; sandwich-tvm reads gpt2 "
                             "(byte-level BPE) and llama (SentencePiece) vocabularies")
    _add_special(tok, tokens, types, byte_level=kind == "gpt2")

    def token(key: str) -> tuple[int | None, str]:
        tid = metadata(reader, f"tokenizer.ggml.{key}_token_id")
        return (tid, tokens[tid]) if isinstance(tid, int) and 0 <= tid < len(tokens) else (None, "")

    (bos_id, bos), (eos_id, eos) = token("bos"), token("eos")
    _add_bos_eos(tok, bos_id if metadata(reader, "tokenizer.ggml.add_bos_token", kind == "llama") else None,
                 eos_id if metadata(reader, "tokenizer.ggml.add_eos_token", False) else None, tokens)
    stops = {tid for tid, _ in (token("eos"), token("eot"), token("eom")) if tid is not None}
    template = metadata(reader, "tokenizer.chat_template")
    return ModelTokenizer(tok, frozenset(stops), template if isinstance(template, str) and template
                          else DEFAULT_CHAT_TEMPLATE, bos_token=bos, eos_token=eos, source=str(path))


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str, where: Path | str = ""):
    """GPT-2-style byte-level BPE over ``tokens`` (ids by position) and ``merges`` ("a b")."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = byte_chars()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (a control token with a space, say) is spelled in it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    llama3 = pre in LLAMA3_PRE
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=llama3))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not llama3)
    if llama3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"),
                                                     byte_level])
    elif pre == "smollm":  # SmolLM's tokenizer.json: every digit its own word
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        if pre not in GPT2_PRE:
            import sys

            print(f"note: {where}: pre-tokenizer {pre!r} is not known here; text is split as GPT-2 "
                  "splits it, which may differ from the model's own tokenizer", file=sys.stderr)
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[str] | None,
                      add_space_prefix: bool, unk_id: int | None = None):
    """SentencePiece BPE with byte fallback as HF's ``LlamaTokenizer`` builds it: ``▁`` for
    spaces (one prepended to the text unless ``add_space_prefix`` is false)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = ([tuple(m.split(" ", 1)) for m in merges] if merges
             else merges_from_scores(vocab, dict(zip(tokens, scores, strict=True))))
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", split=False,
                                                 prepend_scheme="first" if add_space_prefix else "never")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (as ``transformers``' ``generate_merges``):
    every split of a token into two tokens, best-scored merged token first."""
    found = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _add_special(tok, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """Control tokens as special tokens, user-defined ones as added tokens: both matched whole. In
    a byte-level vocabulary a "control" token outside the byte alphabet is a llama.cpp mislabel."""
    from tokenizers import AddedToken

    alphabet = set(byte_chars().values()) if byte_level else None
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=False)
               if k == CONTROL and (alphabet is None or set(t) <= alphabet)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _add_bos_eos(tok, bos_id: int | None, eos_id: int | None, tokens: list[str]) -> None:
    """What ``encode(add_special_tokens=True)`` adds: BOS and/or EOS where the file asks for them."""
    from tokenizers.processors import TemplateProcessing

    if bos_id is None and eos_id is None:
        return
    bos = [(tokens[bos_id], bos_id)] if bos_id is not None else []
    eos = [(tokens[eos_id], eos_id)] if eos_id is not None else []
    pre, post = " ".join(t for t, _ in bos), " ".join(t for t, _ in eos)
    single = " ".join(x for x in (pre, "$A", post) if x)
    pair = " ".join(x for x in (pre, "$A", post, pre, "$B", post) if x)
    tok.post_processor = TemplateProcessing(single=single, pair=pair, special_tokens=list({*bos, *eos}))
