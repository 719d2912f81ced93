"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as pydantic models.

Models are strict: a string where a number belongs is a 400, not a silent coercion, and
NaN/infinity are refused; a whole-number float (`"n": 1.0`) counts as the integer, as in
OpenAI's own server. A field fleetserve does not implement (`tools`, `response_format`,
`logit_bias`, ...) is refused by name, never accepted and ignored; fields the OpenAI SDK
itself writes back (a previous message's `refusal`, `audio`, ... as null) are accepted. Range checks live in
`SamplingParams.validate` (one place for the offline and the online API); the caps that
only the server has are checked here.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
)

from fleetserve.core.sampling_params import MAX_LOGPROBS, SAMPLING_FIELDS, SamplingParams
from fleetserve.core.structured import StructuredOutputsParams
from fleetserve.entrypoints.openai.protocol_tools import (
    ResponseFormat,
    StructuredOutputsBody,
    ToolCall,
    ToolChoice,
    ToolDefinition,
)

MAX_N = 32  # completions per request; each one is a sequence in the batch
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap for the legacy completions API
INT64 = 2**63 - 1


def _whole_number(value: Any) -> Any:
    """16.0 -> 16 (JSON has one number type; clients that send 16.0 mean 16); 16.5 stays a
    float and the strict integer check refuses it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


def _api_type(tp: Any) -> Any:
    """A SamplingParams field's type as the API reads it: every int an `Int`."""
    if tp is int:
        return Int
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, (_api_type(a) for a in args))
    if typing.get_origin(tp) is list:
        return list[_api_type(args[0])]  # type: ignore[misc]
    return tp


# The body's sampling fields are SamplingParams' own (core/sampling_params.SAMPLING_FIELDS):
# same names, types and defaults, so a new sampling field reaches the API, the wire and the
# engine from its one definition. Only the server's own caps are added here. `max_tokens`,
# `logprobs` and `prompt_logprobs` differ per endpoint and are declared by each request.
# `structured_outputs` has its own body model (protocol_tools.StructuredOutputsBody),
# compiled by structured.py into the engine's StructuredOutputsParams.
_PER_ENDPOINT = ("max_tokens", "logprobs", "prompt_logprobs", "structured_outputs")
BODY_SAMPLING_FIELDS = tuple(f for f in SAMPLING_FIELDS if f not in _PER_ENDPOINT)
_CAPS: dict[str, dict[str, Any]] = {
    "n": {"ge": 1, "le": MAX_N},
    "seed": {"ge": -(2**63), "le": INT64},
    "top_k": {"ge": -1, "le": INT64},
    "min_tokens": {"ge": 0, "le": INT64},
}
_HINTS = typing.get_type_hints(SamplingParams)
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
_SamplingBase = create_model(  # type: ignore[call-overload]
    "_SamplingBase",
    __base__=_Strict,
    **{
        name: (_api_type(_HINTS[name]), Field(default=_DEFAULTS[name], **_CAPS.get(name, {})))
        for name in BODY_SAMPLING_FIELDS
    },
)


class _SamplingFields(_SamplingBase):  # type: ignore[misc,valid-type]
    """Fields shared by completions and chat completions: the sampling ones (derived above)
    and the request's own."""

    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1, le=INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # The SLA class (also the X-Fleetserve-Class header); "auto"/"default": the default.
    service_tier: str | None = None
    # vLLM's constraint field: json (a schema), regex, choice, grammar (Lark / GBNF).
    structured_outputs: StructuredOutputsBody | None = None
    # Never stored (store: true is refused); metadata goes to the access log.
    store: bool | None = None
    metadata: dict[str, str] | None = None

    @field_validator("store")
    @classmethod
    def _no_storing(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("fleetserve does not store completions; send store: false or omit it")
        return v

    def sampling_params(
        self,
        max_tokens: Int | None,
        logprobs: Int | None,
        prompt_logprobs: Int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            **{name: getattr(self, name) for name in BODY_SAMPLING_FIELDS},
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = Field(default=16, ge=1, le=INT64)
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "file": "file",
    "video_url": "video",
}


def _text_parts(value: Any) -> Any:
    """A content part list: text parts only; an image (or audio, file) part is refused by
    what it is, not as a type error."""
    if not isinstance(value, list):
        return value
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise ValueError(
                f"part {i} is {_MEDIA_PARTS[kind]} input, which this model does not support "
                "(it reads text only)"
            )
    return value


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts)] = None
    name: str | None = None
    # An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # What the OpenAI SDK writes into a message it returned (message.model_dump()):
    # accepted when empty.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = None
    reasoning_content: None = None

    @field_validator("annotations")
    @classmethod
    def _empty(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("annotations are not read back; send an empty list or null")
        return v

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


# field -> why a non-null value is refused
UNSUPPORTED_CHAT_FIELDS = {
    "audio": "audio output is not supported by this model",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "reasoning_effort": "reasoning_effort is for reasoning models; this model does not reason",
    "verbosity": "verbosity is for reasoning models; this model does not reason",
    "functions": "functions (deprecated) is not supported: send tools",
    "function_call": "function_call (deprecated) is not supported: send tool_choice",
}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=INT64)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI chat fields this server cannot honour: accepted when null or empty (clients
    # send them so), refused by name otherwise. Hints that change no answer are accepted.
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    @field_validator(*UNSUPPORTED_CHAT_FIELDS)
    @classmethod
    def _null_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or v == [] or v == {}:
            return None
        why = UNSUPPORTED_CHAT_FIELDS[str(info.field_name)]
        raise ValueError(f"{why}; send null or omit it")

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v and any(m != "text" for m in v):
            raise ValueError('audio output is not supported (text only): send modalities ["text"]')
        return v
