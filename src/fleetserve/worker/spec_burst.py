"""A lone greedy stream's speculative steps verify on in C: a speculative burst.

Why: with an n-gram drafter one scheduler step verifies ~5 tokens (k=6 on the repeat
workload) in ~9.6 ms of C step, and pays ~1.05 ms of Python around it (scheduler,
metadata, rejection sampling, drafting, outputs): ~10% of the step, where plain decoding
pays its Python once per burst of up to 8 tokens (worker/decode_burst.py). After the
step's own verification (or plain decode), the runner has the C step go on
(`DecodePlan.spec_burst`): look up the next drafts in the sequence as the n-gram proposer
does, verify them as the next step would (the pending token and the drafts as rows of
one step, with the LM head and its argmax), accept the drafts that equal the argmax of
the row before and the target's own token, and again, until `burst_tokens` tokens, a
stop token, max_tokens, or the slots the scheduler reserved for the request
(SchedulerConfig.num_burst_lookahead_tokens) run out.

The tokens are the ones step-by-step verification gives: each round's drafts are those
NgramProposer.propose returns (fixed draft length: the same match, the same count, cut
after a stop token and at max_tokens' room), verified by the same C step on the same
rows; the scheduler counts their K/V as computed as it does for a plain burst
(Scheduler.update_from_output), drops anything after a stop it finds itself (stop
strings, max_model_len), and adds the burst's verifications to the acceptance figures
(ModelRunnerOutput.spec_bursts). Never after a prefill (the first token leaves with the
step that computed it), never under FLEETSERVE_DEBUG_STEP_DELAY_S (burst_plan).
"""

from __future__ import annotations

from typing import Protocol

import torch

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler_output import SpecBurstTally
from fleetserve.kernels.decode_step import BurstInput, DecodePlan, SpecLimits
from fleetserve.kernels.quant import QuantWeight
from fleetserve.spec_decode.config import SpeculativeConfig
from fleetserve.spec_decode.ngram import UNIGRAM_MATCH_DRAFTS
from fleetserve.worker.decode_burst import burst_plan

# max_tokens unset: no cap on the tokens a burst may emit but its budget.
_NO_CAP = 1 << 62


class BurstRequest(Protocol):
    """What a burst reads of the runner's view of a request (model_runner.RequestState)."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    block_ids: list[int]

    @property
    def plain_greedy(self) -> bool: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...


class SpecBurst:
    """Runs a speculative burst on `plan` (with the LM head), embedding through `table`
    (the model's GGUF blocks or float32 rows), drafting as `spec` says."""

    def __init__(
        self,
        plan: DecodePlan,
        table: QuantWeight | torch.Tensor,
        spec: SpeculativeConfig,
        max_model_len: int,
    ) -> None:
        if not spec.bursts:
            raise ValueError("speculative bursts need an n-gram drafter of fixed draft length")
        self.plan = plan
        self._input = BurstInput(plan, table)
        self.spec = spec
        self.max_model_len = max_model_len
        self._tokens = torch.empty(0, dtype=torch.int64)  # the sequence, grown in C
        # Tokens decoded by bursts (tests, benches).
        self.num_tokens = 0

    def extend(self, s: BurstRequest, tokens: list[int]) -> SpecBurstTally | None:
        """Appends to `tokens` (the step's for `s`, greedy: a verification's or a
        decode's) the tokens a burst verifies on after them, and says what it did; None
        (nothing appended) where no burst may run: `s`'s step was not a decode or a
        verification (its pending token the only one not in the cache), not greedy on
        the raw logits, constrained, or it already ends the request."""
        p = s.params
        if (
            not tokens
            or s.num_computed_tokens == 0
            or s.num_computed_tokens != len(s.token_ids) - 1
            or not s.plain_greedy
            or p.structured_outputs is not None
        ):
            return None
        stops = s.stop_ids
        seq = s.token_ids + tokens
        if len(seq) >= self.max_model_len or not stops.isdisjoint(tokens):
            return None
        max_output = None
        if p.max_tokens is not None:
            max_output = p.max_tokens - (len(seq) - s.num_prompt_tokens)
            if max_output <= 0:
                return None
        extra, tally = self.run(seq, s.block_ids, max_output, stops)
        if not extra:
            return None
        tokens += extra
        return tally

    def run(
        self,
        token_ids: list[int],
        block_ids: list[int],
        max_output: int | None,
        stop_ids: frozenset[int],
    ) -> tuple[list[int], SpecBurstTally]:
        """The tokens after `token_ids` (the request's, this step's included: its last is
        pending at position len - 1), at most ~burst_tokens (+ one round's), `max_output`
        at most (None: no max_tokens), ending after one in `stop_ids`."""
        spec = self.spec
        length, budget, k = len(token_ids), spec.burst_tokens, spec.num_speculative_tokens
        need = length + budget + k
        if self._tokens.shape[0] < need:
            self._tokens = torch.empty(max(need, 2 * self._tokens.shape[0]), dtype=torch.int64)
        self._tokens[:length] = torch.tensor(token_ids, dtype=torch.int64)
        limits = SpecLimits(
            budget,
            _NO_CAP if max_output is None else max_output,
            self.max_model_len,
            k,
            min(k, UNIGRAM_MATCH_DRAFTS),
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
        )
        n, (verifications, drafts, accepted) = self.plan.spec_burst(
            self._input,
            self._tokens,
            length,
            torch.tensor(block_ids, dtype=torch.int64),
            limits,
            torch.tensor(sorted(stop_ids), dtype=torch.int64),
        )
        self.num_tokens += n
        out = self._tokens[length : length + n].tolist()
        return out, SpecBurstTally(n, verifications, drafts, accepted)


def make_spec_burst(
    model: object, spec: SpeculativeConfig | None, max_model_len: int
) -> SpecBurst | None:
    """The runner's speculative burst for `model` (its `LlamaForCausalLM.model`), or None:
    no n-gram drafter of fixed length with bursts on, or a model a burst cannot run
    (burst_plan)."""
    if spec is None or not spec.bursts:
        return None
    found = burst_plan(model)
    if found is None:
        return None
    plan, table = found
    return SpecBurst(plan, table, spec, max_model_len)
