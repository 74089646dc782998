"""OpenAI request bodies (pydantic, strict types) and the error shape.

Fields follow OpenAI's API with vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``) and llama-server's ``cache_prompt``
(false: no prefix caching for this request); unknown fields are ignored, as
vLLM and llama-server do, but a known field of the wrong type is a 400. A field sent as
``null`` takes its default, as OpenAI's API reads it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..runtime.sampling import SamplingParams


class _Body(BaseModel):
    """Strict types, unknown fields ignored, ``null`` as absent."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if not isinstance(data, dict):
            return data
        # max_tokens: null means up to the context, as vLLM reads it (absent, a completion's is 16)
        return {k: v for k, v in data.items() if v is not None or k == "max_tokens"}


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    ignore_eos: bool = False
    cache_prompt: bool = True
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None  # vLLM's guided decoding
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # a Lark grammar (llguidance's form)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; ``SamplingError`` names a value out of range."""
        given = {k: v for k, v in {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "seed": self.seed}.items() if v is not None}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, stop=tuple(s for s in stop if s),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              logprobs=logprobs, cache_prompt=self.cache_prompt,
                              logit_bias=self.logit_bias or (), **given)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class ToolName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolName


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize``: a completion ``prompt`` (the tokenizer's BOS added unless
    ``add_special_tokens`` is false, as a completion gets it) or chat ``messages`` rendered by the
    chat template, as a chat completion would be."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int = 400) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
