"""Prompt-lookup (n-gram) proposals: if the sequence's last n tokens occurred before,
propose the tokens that followed that occurrence. Free to compute, and right often on
input-grounded tasks (repeating, editing or quoting the prompt).

How many tokens are proposed depends on how long the matched suffix is: a match of a
single token (when longer ones are allowed) is weak evidence (after the text left the
source, the last token alone points at an arbitrary earlier place), so it proposes one
draft only. Each draft row in the verification step costs ~8% of a one-row step here,
and on the repeat workload a unigram match's first draft was rejected most of the time;
replaying that workload's greedy outputs, capping unigram matches at one draft raised
the modelled speed-up from 2.46x to 2.58x, where no draft, or a cap on bigram matches
too, did worse (docs/benchmarks.md, issue 25 speculative section).

The proposer keeps each running request's n-grams in a dict index (`NgramIndex`),
extended by the tokens each step appends, instead of scanning the sequence every step.
"""

from __future__ import annotations

import time

import numpy as np

from fleetserve.spec_decode.base import Proposal, ProposalRequest
from fleetserve.spec_decode.config import SpeculativeConfig
from fleetserve.spec_decode.draft_length import DraftLengthChooser

# Drafts proposed after a match of one token, when longer matches are allowed.
UNIGRAM_MATCH_DRAFTS = 1


def find_ngram_match(token_ids: list[int] | np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(start, n): the suffix n-gram of ``token_ids`` (the longest, ``max_n`` down to
    ``min_n`` tokens) that occurred before, and where the tokens after its latest earlier
    occurrence start; (-1, 0) when none occurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Candidate starts 0 .. length - n - 1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            return int(hits[-1]) + n, n
    return -1, 0


def find_ngram_continuation(
    token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int
) -> list[int]:
    """The up to ``k`` tokens after the latest earlier occurrence of the longest suffix
    n-gram (``max_n`` down to ``min_n`` tokens) of ``token_ids``; [] when none occurs."""
    start, n = find_ngram_match(token_ids, min_n, max_n)
    if not n:
        return []
    return [int(t) for t in token_ids[start : start + k]]


class NgramIndex:
    """One sequence's n-grams of ``min_n`` .. ``max_n`` tokens, each mapped to its latest
    start, kept up to date as tokens are appended: a lookup is a few dict probes plus the
    new tokens' n-grams, where `find_ngram_match` scans the whole sequence once per n
    (~0.2 ms a step at 200 tokens, paid in every speculative step). Same answers as
    `find_ngram_match`. A sequence that is not an extension of the indexed one (shorter,
    or another token where the indexed one ended) is indexed afresh; the proposer also
    drops a request's index when the runner says the request (re)starts."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._reset()

    def _reset(self) -> None:
        self.length = 0  # tokens indexed: every n-gram ending before the last of them
        self.last = -1  # the last indexed token
        # starts[n - min_n]: n-gram -> its latest start (the sequence's own suffix never
        # counts: it ends at the last token, which no indexed n-gram does).
        self.starts: list[dict[tuple[int, ...], int]] = [
            {} for _ in range(self.min_n, self.max_n + 1)
        ]

    def match(self, token_ids: list[int]) -> tuple[int, int]:
        """(start, n) as `find_ngram_match(token_ids, min_n, max_n)`."""
        seq = token_ids
        length, done = len(seq), self.length
        if length < done or (done and seq[done - 1] != self.last):
            self._reset()
            done = 0
        # The n-grams ending at done - 1 .. length - 2 (the one ending at done - 1 was the
        # sequence's own suffix when it was indexed, so it is added only now).
        min_n, starts = self.min_n, self.starts
        for end in range(max(done - 1, 0), length - 1):
            for j, table in enumerate(starts):
                start = end + 1 - min_n - j
                if start < 0:
                    break
                table[tuple(seq[start : end + 1])] = start
        if length:
            self.length, self.last = length, seq[-1]
        for n in range(min(self.max_n, length - 1), min_n - 1, -1):
            found = starts[n - min_n].get(tuple(seq[length - n :]))
            if found is not None:
                return found + n, n
        return -1, 0


def cut_at_stop(drafts: list[int], stop_token_ids: frozenset[int]) -> list[int]:
    """``drafts`` up to and including the first stop token: verification ends the request
    there (or, before min_tokens, rejects it), so drafts past it are rows never used. On
    the repeat workload the last step of each answer drafted on into the chat template
    after the end-of-turn token (6 of 8 rows wasted, ~2% of the run)."""
    for i, t in enumerate(drafts):
        if t in stop_token_ids:
            return drafts[: i + 1]
    return drafts


def num_drafts_for_match(n: int, k: int, max_n: int) -> int:
    """How many of the ``k`` tokens after a match of ``n`` tokens to propose."""
    if n == 1 and max_n > 1:
        return min(k, UNIGRAM_MATCH_DRAFTS)
    return k


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}  # per running request
        # "adaptive": how many drafts a multi-token match gets is chosen each step
        # (draft_length.py); the last proposal of each request, to learn from its outcome.
        self.chooser = DraftLengthChooser(self.k) if config.draft_length == "adaptive" else None
        self.pending: dict[str, tuple[int, list[int]]] = {}
        self._last_step: float | None = None

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        matches = []
        for r in requests:
            index = self.indexes.get(r.req_id)
            if index is None:
                index = self.indexes[r.req_id] = NgramIndex(self.min_n, self.max_n)
            matches.append(index.match(r.token_ids))
        if self.chooser is not None:
            return self._propose_adaptive(requests, matches)
        out = []
        for r, (start, n) in zip(requests, matches, strict=True):
            k = num_drafts_for_match(n, self.k, self.max_n) if n else 0
            drafts = r.token_ids[start : start + k] if k else []
            out.append(Proposal(cut_at_stop(drafts, r.stop_token_ids)))
        return out

    def _propose_adaptive(
        self, requests: list[ProposalRequest], matches: list[tuple[int, int]]
    ) -> list[Proposal]:
        chooser = self.chooser
        assert chooser is not None
        for r in requests:
            pending = self.pending.pop(r.req_id, None)
            if pending is not None:
                chooser.observe_verification(pending[1], r.token_ids[pending[0] :])
        # A match of one token (when longer ones are allowed) keeps its one draft; the
        # others share the chosen number.
        fixed = [num_drafts_for_match(n, self.k, self.max_n) if n else 0 for _, n in matches]
        num_long = sum(1 for f in fixed if f == self.k)
        base = len(requests) + sum(f for f in fixed if f != self.k)
        k_long = chooser.choose(base, float(len(requests)), num_long)
        out = []
        for r, (start, _), f in zip(requests, matches, fixed, strict=True):
            k = k_long if f == self.k else f
            drafts = cut_at_stop(r.token_ids[start : start + k] if k else [], r.stop_token_ids)
            if drafts:
                self.pending[r.req_id] = (len(r.token_ids), drafts)
            out.append(Proposal(drafts))
        return out

    def note_step(self, num_rows: int, decodes_only: bool) -> None:
        """Called once per step, before `propose`: the step's rows, and whether they were
        all decodes and verifications (a prefill chunk's time says nothing of them)."""
        if self.chooser is None:
            return
        now = time.perf_counter()
        if decodes_only and self._last_step is not None:
            self.chooser.observe_step(num_rows, now - self._last_step)
        self._last_step = now

    def forget(self, req_id: str) -> None:
        self.indexes.pop(req_id, None)
        self.pending.pop(req_id, None)
