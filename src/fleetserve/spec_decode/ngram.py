"""Prompt-lookup (n-gram) proposals: if the sequence's last n tokens occurred before,
propose the tokens that followed that occurrence. Free to compute, and right often on
input-grounded tasks (repeating, editing or quoting the prompt)."""

from __future__ import annotations

import numpy as np

from fleetserve.spec_decode.base import Proposal, ProposalRequest
from fleetserve.spec_decode.config import SpeculativeConfig


def find_ngram_continuation(
    token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int
) -> list[int]:
    """The up to ``k`` tokens after the latest earlier occurrence of the longest suffix
    n-gram (``max_n`` down to ``min_n`` tokens) of ``token_ids``; [] when none occurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Candidate starts 0 .. length - n - 1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [
            Proposal(find_ngram_continuation(r.token_ids, self.k, self.min_n, self.max_n))
            for r in requests
        ]

    def forget(self, req_id: str) -> None:
        pass  # stateless
