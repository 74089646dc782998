"""Structured output and tool calls: what a request asks for, as one grammar, and back.

A request constrains its output with OpenAI's ``response_format`` (``json_object``,
``json_schema``) or one of vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (a Lark grammar, llguidance's own form); at most one of them.

Tools take the chat template's own format where the template has one, as llama.cpp and vLLM
do; today that is the Hermes format (Qwen2.5, Hermes 2/3, SmolLM3...): the template renders the
``tools`` it is given and the history's ``tool_calls`` and ``tool`` messages itself, and the
model answers with ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` blocks, to
which the output is constrained (or free text first, under ``auto``). Every other template gets
llama.cpp's generic format, which needs nothing from it: a system message lists the tools (their
JSON schemas) and asks for one JSON object, and the output is constrained to exactly that
object: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, or, when ``tool_choice`` is
``auto``, ``{"response": "..."}`` instead. History goes back in the same form: an assistant's
``tool_calls`` as that JSON, a ``tool`` message as a user turn holding ``{"tool_response":
...}``, so any template renders it.
"""

from __future__ import annotations

import json
import uuid

from ..runtime.grammar import (
    GrammarError,
    grammar_from_choice,
    grammar_from_json_schema,
    grammar_from_lark,
    grammar_from_regex,
)

TOOL_PROMPT = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    "Answer with one JSON object: {{\"tool_calls\": [{{\"name\": <tool name>, \"arguments\": {{...}}}}]}} "
    "to call tools{either}."
)


def output_grammar(req) -> tuple[str, str] | None:
    """(grammar, the field it came from) of a request's output constraint, None for free text;
    ``GrammarError`` for two constraints at once or one that is malformed."""
    asked = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            asked.append(("response_format", grammar_from_json_schema({"type": "object"})))
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise GrammarError("response_format json_schema needs json_schema.schema")
            asked.append(("response_format", grammar_from_json_schema(fmt.json_schema.schema_)))
    if req.guided_json is not None:
        asked.append(("guided_json", grammar_from_json_schema(req.guided_json)))
    if req.guided_regex is not None:
        asked.append(("guided_regex", grammar_from_regex(req.guided_regex)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", grammar_from_choice(req.guided_choice)))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", grammar_from_lark(req.guided_grammar)))
    if len(asked) > 1:
        raise GrammarError(f"one output constraint per request, not {' and '.join(a for a, _ in asked)}")
    return (asked[0][1], asked[0][0]) if asked else None


def tools_active(req) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def _chosen(req) -> list:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return list(req.tools)
    named = [t for t in req.tools if t.function.name == choice.function.name]
    if not named:
        raise GrammarError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                           f"({', '.join(t.function.name for t in req.tools)})")
    return named


GENERIC, HERMES = "generic", "hermes"


def tool_format(template: str | None) -> str:
    """The tool format of a chat template: ``hermes`` where it renders ``tools`` and asks for
    ``<tool_call>`` blocks, else llama.cpp's ``generic`` one."""
    if template and "<tool_call>" in template and "tools" in template:
        return HERMES
    return GENERIC


def _call_schemas(req) -> list[dict]:
    return [{"type": "object", "properties": {"name": {"const": t.function.name},
                                              "arguments": t.function.parameters or {"type": "object"}},
             "required": ["name", "arguments"], "additionalProperties": False} for t in _chosen(req)]


def template_tools(req) -> list[dict] | None:
    """The tools as a chat template takes them (HF's ``tools=``), None when tools are off."""
    if not tools_active(req):
        return None
    return [{"type": "function", "function": {
        "name": t.function.name, "description": t.function.description or "",
        "parameters": t.function.parameters or {}}} for t in _chosen(req)]


def tool_schema(req) -> dict:
    """The JSON schema every answer of a request with tools follows."""
    array = {"type": "array", "items": {"anyOf": _call_schemas(req)}, "minItems": 1}
    if not req.parallel_tool_calls:
        array["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}
    if req.tool_choice in (None, "auto"):
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return {"anyOf": [call, answer]}
    return call


def tool_grammar(req, fmt: str = GENERIC) -> str:
    """The grammar of a tool answer: the generic JSON object, or Hermes ``<tool_call>`` blocks
    (one, or several when ``parallel_tool_calls``; under ``auto`` free text instead, which does
    not open with ``<``)."""
    if fmt != HERMES:
        return grammar_from_json_schema(tool_schema(req))
    call = {"anyOf": _call_schemas(req), "x-guidance": {"whitespace_flexible": False}}
    calls = 'call ("\\n" call)*' if req.parallel_tool_calls else "call"
    lark = (f'calls: {calls}\ncall: "<tool_call>\\n" obj "\\n</tool_call>"\n'
            f"obj: %json {json.dumps(call)}\n")
    if req.tool_choice in (None, "auto"):
        return grammar_from_lark("start: calls | TEXT\nTEXT: /[^<\\s][\\s\\S]*/\n" + lark)
    return grammar_from_lark("start: calls\n" + lark)


def chat_messages(req, fmt: str = GENERIC) -> list[dict]:
    """The request's messages as the chat template takes them (role/content dicts); in the
    generic format the tool calls and results as JSON text and the tool list as a leading system
    message, in the template's own (``hermes``) as HF passes them (``tool_calls`` with their
    arguments as objects, ``tool`` messages), the tools going to the template (``template_tools``)."""
    if fmt == HERMES:
        return [_native_message(m) for m in req.messages]
    out = []
    for m in req.messages:
        if m.role == "tool":
            out.append({"role": "user", "content": json.dumps(
                {"tool_response": {"tool_call_id": m.tool_call_id, "content": m.text()}})})
        elif m.role == "assistant" and m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                     for c in m.tool_calls]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls})})
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": m.text()})
    if tools_active(req):
        tools = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                             "parameters": t.function.parameters or {}} for t in _chosen(req)])
        auto = req.tool_choice in (None, "auto")
        either = ", or {\"response\": <your answer>} to answer directly" if auto else ""
        text = TOOL_PROMPT.format(tools=tools, either=either)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _native_message(m) -> dict:
    msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.role == "assistant" and m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    if m.role == "tool":
        msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
    return msg


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise GrammarError(f"a tool call's arguments are not JSON: {err}") from err


OPEN, CLOSE = "<tool_call>", "</tool_call>"


def json_value_end(text: str, i: int) -> int | None:
    """Where the JSON object or array starting at ``text[i]`` ends (the index after its closing
    bracket), brackets and quotes inside its strings ignored; None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def hermes_blocks(text: str) -> tuple[list[str], bool]:
    """The JSON texts of a Hermes answer's ``<tool_call>`` blocks, each cut where its value ends
    (a ``</tool_call>`` inside an argument string is text, not the end), and whether every
    block is closed. The last block may be a value still open (a stream's text so far)."""
    s, blocks, pos = text.strip(), [], 0
    while s.startswith(OPEN, pos):
        i = _skip_ws(s, pos + len(OPEN))
        end = json_value_end(s, i)
        if end is None:
            blocks.append(s[i:].rstrip())
            return blocks, False
        blocks.append(s[i:end])
        k = _skip_ws(s, end)
        if not s.startswith(CLOSE, k):
            return blocks, False
        pos = _skip_ws(s, k + len(CLOSE))
    return blocks, bool(blocks)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def parse_tool_output(text: str, fmt: str = GENERIC) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) of a constrained answer. Cut short by max_tokens:
    a direct answer's text so far (what a stream sent), or other text as it is."""
    if fmt == HERMES:
        blocks, whole = hermes_blocks(text)
        if not whole:  # cut short by max_tokens: the calls closed so far, as a stream sent them
            blocks = blocks[:-1]
        try:
            calls = [json.loads(b) for b in blocks]
        except json.JSONDecodeError:
            return text, []
        if not calls:
            return text, []
        text = json.dumps({"tool_calls": calls})
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        from .tool_stream import scan  # (it reads this module's formats)

        cut = scan(text)  # a direct answer cut short: its text so far, as a stream sends it
        return (cut.content if cut.kind == "response" else text), []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        return None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": c.get("name", ""),
                                    "arguments": json.dumps(c.get("arguments", {}))}}
                      for c in value["tool_calls"] if isinstance(c, dict)]
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    return text, []
