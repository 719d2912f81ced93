"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated position: token id -> logprob, for the sampled token plus the top-N.
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
