"""A GGUF's tokenizer: a ``tokenizers.Tokenizer`` rebuilt from llama.cpp's ``tokenizer.ggml.*``
metadata, with its BOS/EOS ids and ``tokenizer.chat_template``.

Two vocabularies, as llama.cpp names them:

- ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen2/3, DeepSeek-Coder) from the vocabulary and merges,
  split before BPE as the model's own ``tokenizer.json`` does (``tokenizer.ggml.pre``:
  ``smollm`` splits digits first, the Llama-3 family by its regex, DeepSeek-Coder by its
  sequence of regexes, GPT-2's own by its; a split not known here is refused rather than
  guessed);
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, TinyLlama, Mistral, Phi-3), as llama.cpp
  runs it: a space is put before the text and before every piece of text that follows a special
  token (as Llama-2's own ``tokenizer.json`` does); the merges are recovered from the token
  scores when the file has none.

Control tokens (type 3) are special tokens, user-defined ones (type 4) plain added tokens, both
matched whole by their text. BOS is added where the file says so, and where it does not say,
where llama.cpp adds it (SentencePiece and the Llama-3 family). Generation stops at EOS, EOT,
EOM and, as in llama.cpp, at the end-of-turn tokens the vocabulary holds by name.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import ModelLoadError
from .gguf import metadata, open_gguf
from .tokenizer import DEFAULT_CHAT_TEMPLATE, ModelTokenizer, byte_chars

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre values of the Llama-3 split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3, and its
# DBRX and SMAUG, which split alike); of them llama.cpp ignores merges and adds BOS for LLAMA3's
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2")
LLAMA3_SPLIT_PRE = (*LLAMA3_PRE, "smaug-bpe", "dbrx")
# GPT-2's split after every digit alone (llama.cpp splits SmolLM's, StarCoder's and Refact's, which
# Granite's GGUFs name, alike)
DIGITS_PRE = ("smollm", "starcoder", "refact")
GPT2_PRE = ("default", "gpt-2", "gpt2", *DIGITS_PRE)
# DeepSeek-Coder's tokenizer.json (and llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_CODER): each
# regex in turn isolates its matches within the pieces the ones before it left
DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                         r"\p{N}")
# DeepSeek-LLM's (LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM): newlines alone, runs of cased letters and of
# ASCII/fullwidth punctuation with at most one leading space, trailing spaces, CJK runs, digit runs
DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
# Mistral's tekken (Mistral-Nemo, Mistral Small 3, Pixtral), the regex of its tokenizer.json: case
# runs split (CamelCase in two), each digit alone, no contractions. As HF's tokenizer splits, which
# llama.cpp's adaptation of it does not quite (it takes every non-ASCII letter for both cases and
# combining marks for non-letters: "helloÉcole" stays one piece there)
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (and llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, which DeepSeek-R1's Qwen distillations and
# Megrez share): Llama 3's split with each digit alone; its tokenizer.json normalizes to NFC first
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")
SEQUENCE_PRE = {"deepseek-coder": DEEPSEEK_CODER_SPLITS, "deepseek-llm": DEEPSEEK_LLM_SPLITS,
                "tekken": (TEKKEN_SPLIT,), **{pre: (QWEN2_SPLIT,) for pre in QWEN2_PRE}}
# where a whole word that is a token is that token whatever the merges (tiktoken's rule; llama.cpp's
# ignore_merges)
WHOLE_WORD_PRE = (*LLAMA3_PRE, "tekken")
# where llama.cpp adds BOS to a byte-level vocabulary whose file does not say
BOS_PRE = (*LLAMA3_PRE, "tekken", "chameleon")
# tokens llama.cpp ends generation at wherever a vocabulary has them (its end-of-generation set)
EOG_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
             "<end_of_turn>", "<EOT>")


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
    pre = metadata(reader, "tokenizer.ggml.pre")
    if pre is None:  # files converted before the key existed: Llama 3's by its vocabulary
        pre = "llama-bpe" if "<|begin_of_text|>" in tokens else "default"
    if kind == "gpt2":
        tok = byte_level_bpe(tokens, merges or [], pre, path, types)
    elif kind == "llama":
        scores = metadata(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True)
        tok = sentencepiece_bpe(tokens, scores, merges, prefix,
                                unk_id=metadata(reader, "tokenizer.ggml.unknown_token_id"))
    else:
        raise ModelLoadError(f"{path}: tokenizer {kind!r} is not supported; sandwich-tvm reads gpt2 "
                             "(byte-level BPE) and llama (SentencePiece) vocabularies")
    _add_special(tok, tokens, types)

    def token(key: str) -> tuple[int | None, str]:
        tid = metadata(reader, f"tokenizer.ggml.{key}_token_id")
        return (tid, tokens[tid]) if isinstance(tid, int) and 0 <= tid < len(tokens) else (None, "")

    (bos_id, bos), (eos_id, eos) = token("bos"), token("eos")
    add_bos = metadata(reader, "tokenizer.ggml.add_bos_token", kind == "llama" or pre in BOS_PRE)
    if add_bos and bos_id is None:
        raise ModelLoadError(f"{path}: tokenizer.ggml.add_bos_token is set but the file names no BOS "
                             "token (tokenizer.ggml.bos_token_id); convert it again")
    _add_bos_eos(tok, bos_id if add_bos else None,
                 eos_id if metadata(reader, "tokenizer.ggml.add_eos_token", False) else None, tokens)
    stops = {tid for tid, _ in (token("eos"), token("eot"), token("eom")) if tid is not None}
    stops |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    template = metadata(reader, "tokenizer.chat_template")
    return ModelTokenizer(tok, frozenset(stops), template if isinstance(template, str) and template
                          else DEFAULT_CHAT_TEMPLATE, bos_token=bos, eos_token=eos, source=str(path))


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str, where: Path | str = "",
                   types: list[int] | None = None):
    """GPT-2-style byte-level BPE over ``tokens`` (ids by position) and ``merges`` ("a b")."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    known = (*LLAMA3_SPLIT_PRE, *GPT2_PRE, *SEQUENCE_PRE)
    if pre not in known:
        raise ModelLoadError(f"{where}: its pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
                             f"(text would split unlike in training); supported: {', '.join(known)}")
    spelling = byte_chars()
    alphabet = set(spelling.values())
    added = {i for i, k in enumerate(types or ()) if k in (CONTROL, USER_DEFINED)}
    # Control and user-defined tokens are their raw text (matched whole, ``_add_special``); another
    # token outside the byte alphabet is spelled in it.
    vocab = {t if set(t) <= alphabet or i in added else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    llama3 = pre in LLAMA3_SPLIT_PRE
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre in WHOLE_WORD_PRE))
    own_split = llama3 or pre in SEQUENCE_PRE  # else ByteLevel's GPT-2 regex splits
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not own_split)
    if pre in QWEN2_PRE:
        tok.normalizer = normalizers.NFC()
    if pre in SEQUENCE_PRE:
        splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in SEQUENCE_PRE[pre]]
        tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    elif llama3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"),
                                                     byte_level])
    elif pre in DIGITS_PRE:  # SmolLM's tokenizer.json: every digit its own word
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[str] | None,
                      add_space_prefix: bool, unk_id: int | None = None):
    """SentencePiece BPE with byte fallback as llama.cpp runs it: ``▁`` for spaces, and unless
    ``add_space_prefix`` is false one more before the text and before every piece of text after a
    special token (the normalizer sees each piece between added tokens on its own)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = ([tuple(m.split(" ", 1)) for m in merges] if merges
             else merges_from_scores(vocab, dict(zip(tokens, scores, strict=True))))
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    spaces = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if add_space_prefix else spaces
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


def _add_special(tok, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special tokens, user-defined ones as added tokens: both matched whole, by
    their text (``convert_hf_to_gguf`` writes added tokens as they read, not byte-spelled)."""
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=False)
               if k == CONTROL]
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
