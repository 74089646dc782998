"""Structured output and tool calls: what a request asks for, as one grammar, and back.

A request constrains its output with OpenAI's ``response_format`` (``json_object``,
``json_schema``) or one of vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (a Lark grammar, llguidance's own form); at most one of them.

Tools use llama.cpp's generic format, which needs nothing from the chat template: a system
message lists the tools (their JSON schemas) and asks for one JSON object, and the output is
constrained to exactly that object: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, or,
when ``tool_choice`` is ``auto``, ``{"response": "..."}`` instead. History goes back in the same
form: an assistant's ``tool_calls`` as that JSON, a ``tool`` message as a user turn holding
``{"tool_response": ...}``, so any template renders it.
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


def tool_schema(req) -> dict:
    """The JSON schema every answer of a request with tools follows."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": t.function.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in _chosen(req)]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not req.parallel_tool_calls:
        array["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}
    if req.tool_choice in (None, "auto"):
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return {"anyOf": [call, answer]}
    return call


def tool_grammar(req) -> str:
    return grammar_from_json_schema(tool_schema(req))


def chat_messages(req) -> list[dict]:
    """The request's messages as the chat template takes them (role/content dicts), tool calls and
    results in the generic format, the tool list as a leading system message when tools are on."""
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


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise GrammarError(f"a tool call's arguments are not JSON: {err}") from err


def parse_tool_output(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) of a constrained answer; text that is not the
    expected JSON (cut short by max_tokens) comes back as content."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        return None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": c.get("name", ""),
                                    "arguments": json.dumps(c.get("arguments", {}))}}
                      for c in value["tool_calls"] if isinstance(c, dict)]
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    return text, []
