"""A request's life inside the engine core (pure Python, no torch)."""

from __future__ import annotations

import enum
import time

from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.structured import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


class Request:
    """Token ids known so far and how many of them have K/V in the cache.

    ``num_computed_tokens`` catches up with ``num_tokens`` each step; the gap is what the
    scheduler hands out. That single rule yields chunked prefill, prefix reuse and
    recompute after preemption.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        group_id: str | None = None,
        output_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Siblings of one n>1 request share a group id: they wait for the first one's
        # prompt blocks so that they reuse them through the prefix cache.
        self.group_id = group_id
        # A request resumed on this engine after its replica was lost (migration) comes
        # with the tokens it had generated there; like a preempted request, it recomputes
        # their K/V and samples on from the next position.
        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.all_token_ids: list[int] = list(prompt_token_ids) + self.output_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits when first scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Hashes of this request's full blocks, in order; appended by the BlockManager.
        self.block_hashes: list[int] = []
        # Draft tokens proposed after the last step, to verify in the next one. They are
        # not part of the request's tokens until the target model accepts them.
        self.spec_token_ids: list[int] = []
        # Structured outputs: where the request is in its grammar (set at admission by
        # the engine core; advanced with every accepted token).
        self.grammar: GrammarMatcher | None = None
        # The LoRA adapter the request runs with (None: the base model).
        self.lora_request = lora_request

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def cache_salt(self) -> int | None:
        """Seeds the prefix-cache hash chain: K/V computed under an adapter are only
        ever hits for requests of the same adapter (None: the base model)."""
        return None if self.lora_request is None else self.lora_request.cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 30

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def accept_grammar_token(self, token_id: int) -> bool:
        """Advance the grammar past `token_id`; True when the request is finished by it
        (the grammar refused the token, or it is complete and allows only the end)."""
        if self.grammar is None:
            return False
        if not self.grammar.consume([token_id]):
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None
            return True
        if self.grammar.is_terminated() and not self.finished:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None
            return True
        return False

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stops (length, EOS, stop_token_ids). Stop strings need text and are
        checked by the engine after detokenizing."""
        out = self.output_token_ids
        if not out:
            return False
        sp = self.sampling_params
        num_out = len(out)
        max_tokens = sp.max_tokens
        if (max_tokens is not None and num_out >= max_tokens) or len(
            self.all_token_ids
        ) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if num_out < sp.min_tokens:
            return False
        last = out[-1]
        if not sp.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None
            return True
        if sp.stop_token_ids and last in sp.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
