"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as pydantic models.

Models are strict: a string where a number belongs is a 400, not a silent coercion, and
NaN/infinity are refused; a whole-number float (`"n": 1.0`) counts as the integer, as in
OpenAI's own server. A field fleetserve does not implement (`tools`, `response_format`,
`logit_bias`, ...) is refused by name, never accepted and ignored. Range checks live in
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

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from fleetserve.core.sampling_params import MAX_LOGPROBS, SAMPLING_FIELDS, SamplingParams

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
_PER_ENDPOINT = ("max_tokens", "logprobs", "prompt_logprobs")
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

    def sampling_params(
        self, max_tokens: Int | None, logprobs: Int | None, prompt_logprobs: Int | None = None
    ) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            **{name: getattr(self, name) for name in BODY_SAMPLING_FIELDS},
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=INT64)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
