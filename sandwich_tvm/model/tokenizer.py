"""The model's tokenizer, end-of-sequence ids and chat template.

A checkpoint directory brings its own ``tokenizer.json`` (read with ``tokenizers``), its EOS ids
(``config.json``, ``generation_config.json``, ``tokenizer_config.json``) and its chat template
(``chat_template.jinja``, where current ``transformers`` writes it, else ``tokenizer_config.json``'s
``chat_template``; rendered with jinja2 as HF does). A GGUF (or a named model) brings all three in
its metadata (``gguf_tokenizer``). A preset has
random weights and no vocabulary, so it gets a placeholder with llama.cpp's SentencePiece
layout, the one the GGUF baseline is written with: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the 256
bytes at 3..258 (so any text encodes, byte by byte) and ``t<id>`` for every other id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .checkpoint import ModelLoadError
from .config import PRESETS, model_path

# Used when a checkpoint has no chat_template (and for presets): ChatML, one turn per message.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BYTE_OFFSET = 3  # the placeholder vocabulary's byte 0


class ChatTemplateError(ValueError):
    """Messages the chat template cannot render (its own ``raise_exception`` or a jinja2 error)."""


@dataclass
class ModelTokenizer:
    """``tokenizers.Tokenizer`` plus what generation needs around it."""

    tok: object
    eos_ids: frozenset[int]
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    bos_token: str = ""
    eos_token: str = ""
    source: str = ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor
        adds (a raw prompt's BOS, as HF's ``generate`` does; a chat template writes its own)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def token_to_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def prompt_ids(self, text: str) -> list[int]:
        """A raw prompt's ids: BOS first where this tokenizer adds one (not a second one when the
        text already starts with it), and never the EOS some post-processors append."""
        ids, bos = self.encode(text), self._added_bos
        return ids if bos is None or ids[:1] == [bos] else [bos, *ids]

    @cached_property
    def _added_bos(self) -> int | None:
        """The BOS id this tokenizer's post-processor puts first, or None."""
        bos = self.token_to_id(self.bos_token) if self.bos_token else None
        return bos if bos is not None and self.encode("a", add_special_tokens=True)[:1] == [bos] else None

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, as OpenAI's logprobs report them, out of context: a
        byte piece (``<0xE4>``) its byte, a byte-level BPE piece through GPT-2's byte map,
        SentencePiece's ``▁`` a space; a special token its text."""
        piece = self.tok.id_to_token(int(token))
        if piece is None:
            return b""
        byte = byte_piece(piece)
        if byte is not None:
            return bytes([byte])
        if self._byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    @cached_property
    def _byte_level(self) -> bool:
        return decoder_uses(self.tok, "ByteLevel")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        from datetime import datetime

        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # as transformers' apply_chat_template: {% break %}/{% continue %}, raise_exception and
        # strftime_now (Llama 3.1+'s templates date their system prompt with it)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(message: str):
            raise ChatTemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
            # HF's filter: jinja2's own escapes <, > and & as HTML (tool schemas in a prompt)
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        try:
            return env.from_string(self.chat_template)
        except TemplateError as err:
            raise ModelLoadError(f"{self.source}: the chat template does not parse ({err})") from err

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The prompt text for ``messages`` (``role``/``content`` dicts), as HF's
        ``apply_chat_template`` renders it (with ``tools``, for a template that lists them)."""
        from jinja2.exceptions import TemplateError

        extra = {"tools": tools} if tools is not None else {}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template failed on these messages: {err}") from err


def byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what the ByteLevel pre-tokenizer emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        chars[b] = chr(b) if b in keep else chr(256 + (extra := extra + 1) - 1)
    return chars


_BYTE_OF = {c: b for b, c in byte_chars().items()}


def byte_piece(piece: str) -> int | None:
    """The byte a SentencePiece byte-fallback piece (``<0xE4>``) stands for, else None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def decoder_uses(tok, kind: str) -> bool:
    """Whether the decoder of ``tok`` (a ``tokenizers.Tokenizer``, or a wrapper of one in ``.tok``)
    has a step of type ``kind`` (``ByteLevel``, ``ByteFallback``)."""
    decoder = getattr(getattr(tok, "tok", tok), "decoder", None)
    try:
        return decoder is not None and f'"{kind}"'.encode() in decoder.__getstate__()
    except (AttributeError, TypeError):
        return False


def placeholder_tokenizer(vocab_size: int):
    """llama.cpp's SentencePiece layout as a byte-level ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = byte_chars()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {chars[b]: BYTE_OFFSET + b for b in range(256)}
    vocab |= {f"t{i}": i for i in range(BYTE_OFFSET + 256, vocab_size)}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tok


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path} is not valid JSON ({err}); re-download it") from err
    return data if isinstance(data, dict) else {}


def _read_text(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path} cannot be read as UTF-8 text ({err}); re-download it") from err


def _token_text(v) -> str:
    """tokenizer_config's special tokens are strings or AddedToken dicts."""
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return v if isinstance(v, str) else ""


def _ids(v) -> set[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return {v}
    if isinstance(v, list):
        return {x for x in v if isinstance(x, int) and not isinstance(x, bool)}
    return set()


def _read_tokenizer_json(path: Path):
    """``tokenizer.json`` through ``tokenizers``; None when the directory has none."""
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception
        raise ModelLoadError(f"{path} is not a valid tokenizer ({err}); re-download it") from err


def load_model_tokenizer(spec: str | Path) -> ModelTokenizer | None:
    """The tokenizer of a preset (the placeholder), a GGUF or named model (from its metadata; a
    ``ModelLoadError`` when it has none) or a checkpoint directory (None without
    ``tokenizer.json``: token-id prompts still work). The one tokenizer loader: its ``eos_ids``
    are the one list of stop ids."""
    if str(spec) in PRESETS:
        cfg = PRESETS[str(spec)]
        return ModelTokenizer(placeholder_tokenizer(cfg.vocab_size), frozenset({2}), bos_token="<s>",
                              eos_token="</s>", source=f"{spec} (placeholder vocabulary)")
    path = model_path(spec)
    if path.suffix == ".gguf":
        from .gguf_tokenizer import gguf_model_tokenizer

        return gguf_model_tokenizer(path)
    tok = _read_tokenizer_json(path / "tokenizer.json")
    if tok is None:
        return None
    tcfg = _json(path / "tokenizer_config.json")
    eos_ids = _ids(_json(path / "config.json").get("eos_token_id"))
    eos_ids |= _ids(_json(path / "generation_config.json").get("eos_token_id"))
    eos_token, bos_token = _token_text(tcfg.get("eos_token")), _token_text(tcfg.get("bos_token"))
    for text in (eos_token, "</s>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>", "<|end|>"):
        tid = tok.token_to_id(text) if text else None
        if tid is not None and (text == eos_token or not eos_ids):
            eos_ids.add(tid)
    template = _read_text(path / "chat_template.jinja") or tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return ModelTokenizer(tok, frozenset(eos_ids), template if isinstance(template, str) and template
                          else DEFAULT_CHAT_TEMPLATE, bos_token=bos_token, eos_token=eos_token,
                          source=str(path))
