"""What crosses the scheduler -> model runner -> scheduler boundary.

Plain dataclasses of lists and ints, so they serialize cheaply between processes. New
requests travel whole; running ones only as diffs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.structured import GrammarBitmask


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + any output so far (a resumed request recomputes them)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Output tokens the request already had (after preemption): penalties need them.
    num_output_tokens: int = 0
    # Banned from sampling until min_tokens outputs (unless ignore_eos).
    eos_token_ids: tuple[int, ...] = ()
    # The sliding-window layers' own blocks (a model with local and global layers).
    window_block_ids: list[int] | None = None
    # The LoRA adapter the request's rows run with (None: the base model).
    lora_name: str | None = None


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]  # tokens appended since the runner last saw the request
    new_block_ids: list[int]
    num_computed_tokens: int
    # Set when blocks were given back since the runner last saw the request (rejected
    # draft tokens' blocks): keep this many block ids, then append new_block_ids.
    num_kept_block_ids: int | None = None
    # The same two for the sliding-window layers' own block list (hybrid models only).
    new_window_block_ids: list[int] | None = None
    num_kept_window_block_ids: int | None = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner should forget (finished, aborted or preempted since last step).
    finished_req_ids: set[str] = field(default_factory=set)
    # Draft tokens to verify, per request that has some: they follow the request's known
    # tokens and are counted in its num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs: the token masks of the constrained requests that sample now.
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One entry per scheduled request; empty when the step ended mid-prompt. With draft
    # tokens: the accepted drafts, then one token of the target's own. Without drafts,
    # several tokens: a burst (worker/decode_burst.py), each decoded after the one before.
    sampled_token_ids: list[list[int]]
    # Per request, per sampled token: {token_id: logprob} (sampled token + top-N).
    logprobs: list[list[dict[int, float]]] | None = None
    # Per request with prompt_logprobs: entries for the prompt positions this step covered.
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    # Speculative decoding: per request, the draft tokens proposed for the next step
    # (None when speculation is off).
    spec_token_ids: list[list[int]] | None = None
    # Speculative bursts (worker/spec_burst.py): per request whose sampled tokens end with
    # a burst's, what the burst did.
    spec_bursts: dict[str, SpecBurstTally] = field(default_factory=dict)


@dataclass(frozen=True)
class SpecBurstTally:
    """A speculative burst's tokens (the last of the request's sampled tokens) and its
    verifications, the drafts they verified and the drafts accepted (its rounds without
    a match are plain decodes)."""

    num_tokens: int
    num_verifications: int
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    new_prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
