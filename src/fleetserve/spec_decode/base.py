"""The proposer contract: draft tokens for the next step of requests that just sampled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fleetserve.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProposalRequest:
    req_id: str
    token_ids: list[int]  # every verified token, the ones sampled this step included
    block_ids: list[int]  # the request's KV blocks (a draft model writes its K/V there)
    params: SamplingParams
    # Tokens that end the request (its stop_token_ids, and the model's end-of-sequence
    # ids unless ignore_eos): a draft past one is never used (the n-gram proposer cuts
    # its drafts there).
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]  # at most num_speculative_tokens drafts (maybe none)
    # [len(token_ids), vocab]: the distribution each draft was drawn from, for the
    # rejection sampler. None: the drafts are a point mass (a deterministic proposer).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Called by the model runner once per step, after sampling, with every request that
    got tokens in the step (possibly some that a stop condition is about to end).
    ``note_step`` tells it each step's size (the adaptive n-gram proposer times steps).
    ``forget`` is called when a request finishes, is preempted or (re)starts, so that a
    proposer keeping per-request state starts that request afresh."""

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]: ...

    def note_step(self, num_rows: int, decodes_only: bool) -> None:
        """Called once per step on the last stage, before `propose`: the step's rows and
        whether every row was a decode or a verification."""

    def forget(self, req_id: str) -> None: ...
