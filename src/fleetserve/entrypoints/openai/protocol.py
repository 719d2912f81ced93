"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as pydantic models.

Models are strict: a string where a number belongs is a 400, not a silent coercion, and
NaN/infinity are refused; a whole-number float (`"n": 1.0`) counts as the integer, as in
OpenAI's own server. A field fleetserve does not implement (`tools`, `response_format`,
`logit_bias`, ...) is refused by name, never accepted and ignored. Range checks live in
`SamplingParams.validate` (one place for the offline and the online API); the caps that
only the server has are checked here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from fleetserve.core.sampling_params import MAX_LOGPROBS, SamplingParams

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


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1, le=INT64)
    temperature: float = 1.0
    top_p: float = 1.0
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=-(2**63), le=INT64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras, which clients already send.
    top_k: Int = Field(default=-1, ge=-1, le=INT64)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: Int = Field(default=0, ge=0, le=INT64)
    stop_token_ids: list[Int] | None = None
    priority: Int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling_params(
        self, max_tokens: Int | None, logprobs: Int | None, prompt_logprobs: Int | None = None
    ) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
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
