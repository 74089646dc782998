"""Tool calls streamed as they are generated, in OpenAI's chunk shape.

The constrained output is a prefix of ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``
or of ``{"response": "..."}`` (``structured.tool_schema``). ``scan`` reads such a prefix,
wherever it stops, and ``ToolCallStream`` turns the growth between two prefixes into deltas, as
vLLM and the OpenAI API send them: a call's first delta carries its index, id, type and name
(arguments ``""``) once the name is whole, later ones the new characters of its arguments' JSON
text; a direct answer streams as content, its string decoded. Tokens are never taken back under
a grammar, so what was sent stays true, and the arguments' pieces join into the JSON the model
wrote. A Hermes answer (``<tool_call>`` blocks, ``structured.HERMES``) is read as the generic
prefix its blocks make; free text in its place streams as it is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .structured import GENERIC, HERMES, OPEN, hermes_blocks

_WS = " \t\r\n"


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a whole JSON string (the regex engine's loop)
_BRACKETS = re.compile(r'["{}\[\]]')  # what changes the depth inside an object or array
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # from inside a string to its quote


def _string_end(text: str, i: int) -> int | None:
    """Index past the JSON string opening at ``text[i]`` (a quote), None if it is cut short."""
    m = _STRING.match(text, i)
    return m.end() if m else None


def _value_end(text: str, i: int) -> int | None:
    """Index past the JSON value at ``text[i]``, None if it is cut short."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        j = i
        while j < len(text) and text[j] not in ",}]" + _WS:
            j += 1
        return j if j < len(text) else None
    depth, j = 0, i
    while (m := _BRACKETS.search(text, j)) is not None:  # each scanned by the regex engine, not a loop
        j, c = m.start(), m.group()
        if c == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        depth += 1 if c in "{[" else -1
        if depth == 0:
            return j + 1
        j += 1
    return None


def _partial_string(raw: str) -> str:
    """The decoded text of a JSON string (``raw`` opens with its quote) as far as it is whole:
    without the closing quote, and without an escape that has not arrived whole."""
    end = _string_end(raw, 0)
    body = raw[1:end - 1] if end is not None else raw[1:]
    for cut in range(len(body), max(len(body) - 6, 0) - 1, -1):  # an escape is at most 6 long
        try:
            text = json.loads(f'"{body[:cut]}"')
        except json.JSONDecodeError:
            continue
        if end is None and text and "\ud800" <= text[-1] <= "\udbff":
            text = text[:-1]  # a surrogate pair's first half: the second is still to come
        return text
    return ""


@dataclass
class Call:
    """One tool call as far as the prefix goes."""

    name: str | None = None  # None until the name's string is whole
    arguments: str = ""  # the JSON text of its arguments so far


@dataclass
class Scan:
    kind: str | None = None  # "tool_calls", "response" or None (not known yet)
    calls: list[Call] = field(default_factory=list)
    content: str = ""  # the direct answer's text so far


def _key(text: str, i: int) -> tuple[str, int] | None:
    """An object's key at ``text[i]`` and the index of its value past the colon, None if cut short."""
    end = _string_end(text, i) if i < len(text) and text[i] == '"' else None
    if end is None:
        return None
    colon = _ws(text, end)
    if colon >= len(text) or text[colon] != ":":
        return None
    return json.loads(text[i:end]), _ws(text, colon + 1)


def scan(text: str) -> Scan:
    """What a prefix of the tool output holds, however far it goes."""
    out = Scan()
    i = _ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return out
    found = _key(text, _ws(text, i + 1))
    if found is None:
        return out
    key, i = found
    if key == "response":
        out.kind = "response"
        if i < len(text) and text[i] == '"':
            out.content = _partial_string(text[i:])
        return out
    if key != "tool_calls":
        return out
    out.kind = "tool_calls"
    if i >= len(text) or text[i] != "[":
        return out
    i += 1
    while True:
        i = _ws(text, i)
        if i >= len(text) or text[i] != "{":
            return out
        call = Call()
        out.calls.append(call)
        i = _ws(text, i + 1)
        while i < len(text) and text[i] == '"':  # the call's members
            found = _key(text, i)
            if found is None:
                return out
            member, i = found
            end = _value_end(text, i)
            if member == "name" and end is not None:
                call.name = json.loads(text[i:end])
            elif member == "arguments":
                call.arguments = text[i:end] if end is not None else text[i:]
            if end is None:
                return out
            i = _ws(text, end)
            if i < len(text) and text[i] == ",":
                i = _ws(text, i + 1)
        if i >= len(text) or text[i] != "}":
            return out
        i = _ws(text, i + 1)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        return out


def hermes_as_generic(text: str) -> str | None:
    """The generic-format prefix a Hermes answer so far amounts to (``""`` while its opening
    cannot tell), or None for free text."""
    s = text.lstrip()
    if not s.startswith(OPEN):
        return "" if OPEN.startswith(s) else None
    return '{"tool_calls": [' + ", ".join(hermes_blocks(s)[0])


class _StringReader:
    """A JSON string's decoded text as its raw text grows, each character decoded once."""

    _UNITS = re.compile(r'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*')  # whole characters and escapes

    def __init__(self, quote: int) -> None:
        self.pos, self.text, self.closed = quote + 1, "", False

    def read(self, raw: str) -> str:
        if not self.closed:
            m = self._UNITS.match(raw, self.pos)
            piece = m.group()
            self.closed = m.end() < len(raw) and raw[m.end()] == '"'
            text = json.loads(f'"{piece}"') if piece else ""
            if not self.closed and text and "\ud800" <= text[-1] <= "\udbff":
                text, piece = text[:-1], piece[:-6]  # a surrogate pair's first half: wait for the second
            self.text += text
            self.pos += len(piece)
        return self.text


class _CallReader:
    """One call object of the answer, read as it grows: its name once whole, its arguments' JSON
    text as far as it goes, and where the object ends. The arguments are scanned once: the
    reader resumes where it stopped, inside a string too."""

    def __init__(self, brace: int) -> None:
        self.call = Call()
        self.pos = brace + 1  # past the last member read
        self.args_at: int | None = None  # where the arguments' value starts
        self.scan_at, self.depth, self.in_string = 0, 0, False  # the arguments' scan so far
        self.end: int | None = None  # past the call's closing brace

    def read(self, text: str) -> None:
        while self.end is None:
            if self.args_at is not None:
                stop = self._scan_arguments(text)
                if stop is None:
                    return
                self.pos, self.args_at = stop, None
                continue
            i = _ws(text, self.pos)  # a member, a comma before one, or the closing brace
            if i < len(text) and text[i] == ",":
                i = _ws(text, i + 1)
            if i < len(text) and text[i] == "}":
                self.end = i + 1
                return
            found = _key(text, i) if i < len(text) and text[i] == '"' else None
            if found is None:
                return
            member, value = found
            if value >= len(text):  # the value has not begun: read the key again next time
                return
            if member == "arguments":
                self.args_at, self.scan_at, self.depth, self.in_string = value, value, 0, False
                continue
            end = _value_end(text, value)
            if end is None:
                return
            if member == "name":
                self.call.name = json.loads(text[value:end])
            self.pos = end

    def _scan_arguments(self, text: str) -> int | None:
        """Past the arguments' value when it is whole (None if not yet); their text so far is set."""
        start = self.args_at
        assert start is not None
        if start < len(text) and text[start] not in "{[":  # a scalar: short, read whole
            end = _value_end(text, start)
            self.call.arguments = text[start:end] if end is not None else text[start:]
            return end
        j = self.scan_at
        while True:
            if self.in_string:  # resume inside the string: its body so far, never re-read
                j = _STRING_BODY.match(text, j).end()
                if j >= len(text) or text[j] != '"':
                    break  # cut short (before a lone trailing backslash, at most)
                j, self.in_string = j + 1, False
                continue
            m = _BRACKETS.search(text, j)
            if m is None:
                j = len(text)
                break
            j, c = m.end(), m.group()
            if c == '"':
                self.in_string = True
                continue
            self.depth += 1 if c in "{[" else -1
            if self.depth == 0:
                self.call.arguments = text[start:j]
                return j
        self.scan_at = j  # nothing before j is read again
        self.call.arguments = text[start:]
        return None


class ToolCallStream:
    """Deltas of a streamed tool answer: ``feed`` the whole text so far, get the chunk deltas
    (``{"tool_calls": [...]}`` or ``{"content": ...}``) its growth adds. The text only grows
    (tokens under a grammar are never taken back), so each feed reads only what is new: whole
    calls are not read again, nor the decoded part of an answer."""

    def __init__(self, fmt: str = GENERIC) -> None:
        self.fmt = fmt
        self.ids: list[str] = []  # one per call whose head was sent
        self.sent_args: list[int] = []
        self.sent_content = 0
        self.kind: str | None = None
        self.answer: _StringReader | None = None
        self.calls: list[_CallReader] = []
        self.next_call: int | None = None  # where the value opens, then where the next call may start
        self.opened = False  # the call list's "[" was read

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str) -> list[dict]:
        if self.fmt == HERMES:
            generic = hermes_as_generic(text)
            if generic is None:  # a direct answer, as it is
                delta, self.sent_content = text[self.sent_content:], len(text)
                return [{"content": delta}] if delta else []
            text = generic
        if self.kind is None:
            self._begin(text)
        if self.kind == "response":
            if self.answer is None and self.next_call is not None:  # the string opens at its quote
                i = _ws(text, self.next_call)
                if i < len(text) and text[i] == '"':
                    self.answer = _StringReader(i)
            content = self.answer.read(text) if self.answer is not None else ""
            if len(content) > self.sent_content:
                delta, self.sent_content = content[self.sent_content:], len(content)
                return [{"content": delta}]
            return []
        return self._call_deltas(text) if self.kind == "tool_calls" else []

    def _begin(self, text: str) -> None:
        """The answer's kind (and where its value starts), once its key is whole."""
        i = _ws(text, 0)
        if i >= len(text) or text[i] != "{":
            return
        found = _key(text, _ws(text, i + 1))
        if found is None:
            return
        key, value = found
        if key in ("response", "tool_calls"):
            self.kind = key
            self.next_call = value  # where the value opens: the answer's quote, or the list's "["
            self.opened = False

    def _read_calls(self, text: str) -> None:
        if not self.opened:  # past the list's "["
            i = _ws(text, self.next_call)
            if i >= len(text) or text[i] != "[":
                return
            self.next_call, self.opened = i + 1, True
        while True:
            if self.calls and self.calls[-1].end is None:
                self.calls[-1].read(text)
                if self.calls[-1].end is None:
                    return
                self.next_call = self.calls[-1].end
            i = _ws(text, self.next_call)
            if self.calls:
                if i >= len(text) or text[i] != ",":
                    return
                i = _ws(text, i + 1)
            if i >= len(text) or text[i] != "{":
                return
            self.calls.append(_CallReader(i))

    def _call_deltas(self, text: str) -> list[dict]:
        self._read_calls(text)
        deltas: list[dict] = []
        for index, reader in enumerate(self.calls):
            call = reader.call
            if index == len(self.ids):
                if call.name is None:
                    break  # its head waits for the whole name; later calls wait for it
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.sent_args.append(0)
                deltas.append({"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > self.sent_args[index]:
                deltas.append({"tool_calls": [{"index": index, "function": {
                    "arguments": call.arguments[self.sent_args[index]:]}}]})
                self.sent_args[index] = len(call.arguments)
        return deltas
