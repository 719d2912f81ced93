"""Verify draft tokens against the target model's distributions in one step.

For each request with drafts d_1..d_k the target gives k + 1 rows of logits: row j is
its distribution for the token after the sequence plus d_1..d_j. Under greedy sampling
a draft is accepted while it equals the target's argmax; the first mismatch is replaced
by the argmax, and when all k match the target's own next token (the bonus) follows, so
the output is token for token what decoding without drafts would give.

Under random sampling (Leviathan et al., 2023) d_j, drawn from the draft distribution q,
is accepted with probability min(1, p(d_j) / q(d_j)); on rejection a token is drawn from
norm(max(0, p - q)) and verification stops. Each emitted token is then distributed as p,
the target's distribution after penalties, temperature and top-k/top-p/min-p, exactly as
the plain sampler would draw it. An n-gram proposal is a point mass: q(d_j) = 1, so d_j is
accepted with probability p(d_j) and a rejection draws from p with d_j removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fleetserve.layers.sampler import (
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    argmax_rows,
    filter_logits,
    top_logprobs,
)


@dataclass(frozen=True)
class DraftedRow:
    row: SamplingRow  # the request as the plain sampler sees it (outputs before the drafts)
    draft_token_ids: list[int]
    # [k, vocab] the distribution each draft was drawn from; None: a point mass.
    draft_probs: torch.Tensor | None = None


def _generator(row: SamplingRow, fallback: torch.Generator) -> torch.Generator:
    """A seeded request draws from (seed, output position): reproducible whatever else is
    in the batch (salted apart from the plain sampler's stream for the same position)."""
    seed = row.params.seed
    if seed is None:
        return fallback
    g = torch.Generator()
    g.manual_seed(hash((seed, len(row.output_token_ids), 1)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax as a list (layers/sampler.py's numpy argmax: ~20x torch's on
    [k + 1, 49k] float32 rows, paid in every verification step)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2:
        return np.argmax(logits.detach().numpy(), axis=-1).tolist()  # type: ignore[no-any-return]
    return argmax_rows(logits).tolist()  # type: ignore[no-any-return]


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that changes the logits of this row or of its drafts' rows."""
    p = row.params
    return p.greedy and not p.needs_penalties and len(row.output_token_ids) >= p.min_tokens


def _rows_with_drafts(requests: list[DraftedRow]) -> list[SamplingRow]:
    """Each request's k + 1 rows as the plain sampler sees them: row j has the first j
    drafts among its outputs (penalties and min_tokens see them)."""
    rows: list[SamplingRow] = []
    for r in requests:
        base = r.row
        for j in range(len(r.draft_token_ids) + 1):
            outputs = base.output_token_ids + r.draft_token_ids[:j]
            rows.append(
                SamplingRow(base.params, base.prompt_token_ids, outputs, base.eos_token_ids)
            )
    return rows


def _draw(weights: torch.Tensor, g: torch.Generator) -> int:
    """One token from unnormalized non-negative weights (the plain sampler's exponential
    race: argmax(w / E) with E ~ Exp(1))."""
    noise = torch.empty_like(weights).exponential_(generator=g)
    return int((weights / noise).argmax())


class RejectionSampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # shared with the plain sampler for unseeded requests

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[DraftedRow],
        argmax: torch.Tensor | None = None,
    ) -> tuple[list[list[int]], list[list[dict[int, float]]] | None]:
        """logits: [sum(k_i + 1), vocab], each request's k_i + 1 rows back to back;
        argmax: those rows' argmax (the first maximum, as numpy's) when the C step's LM
        head found it (None: found here). Returns per request the accepted drafts plus one
        token of the target's, and their logprobs when asked for (of the raw target
        distribution, like the sampler's)."""
        want_lp = any(r.row.params.logprobs is not None for r in requests)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
        probs = None
        prob_row: dict[int, int] = {}
        if all(_plain_greedy(r.row) for r in requests):
            # The common case (greedy, no penalties, min_tokens reached): the raw logits'
            # argmax decides; no per-row SamplingRow to build (nor a scan of the logits
            # when the C step's head found each row's argmax: ~0.14 ms for 8 x 49k).
            best = _argmax_rows(logits) if argmax is None else argmax.tolist()
        else:
            rows = _rows_with_drafts(requests)
            if any(r.params.needs_penalties for r in rows):
                logits = apply_penalties(logits.clone(), rows)
            if any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
                logits = apply_min_tokens(logits.clone(), rows)
            best = _argmax_rows(logits)
            random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
            if random_idx:
                kept = filter_logits(logits[random_idx], [rows[i] for i in random_idx])
                probs = kept.softmax(-1)
            prob_row = {i: j for j, i in enumerate(random_idx)}

        out: list[list[int]] = []
        out_lps: list[list[dict[int, float]]] = []
        first = 0
        for r in requests:
            k = len(r.draft_token_ids)
            if r.row.params.greedy:
                tokens = self._verify_greedy(r.draft_token_ids, best[first : first + k + 1])
            else:
                assert probs is not None
                p = probs[prob_row[first] : prob_row[first] + k + 1]
                tokens = self._verify_random(r, p)
            out.append(tokens)
            n = r.row.params.logprobs
            if raw_logprobs is not None:
                out_lps.append(
                    [top_logprobs(raw_logprobs[first + j], t, n) for j, t in enumerate(tokens)]
                    if n is not None
                    else [{} for _ in tokens]
                )
            first += k + 1
        return out, (out_lps if raw_logprobs is not None else None)

    @staticmethod
    def _verify_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
        tokens: list[int] = []
        for d, t in zip(drafts, argmax, strict=False):
            tokens.append(t)
            if t != d:
                return tokens
        tokens.append(argmax[len(drafts)])  # every draft accepted: the bonus token
        return tokens

    def _verify_random(self, r: DraftedRow, p: torch.Tensor) -> list[int]:
        """p: [k + 1, vocab] target probabilities, row j given the drafts before j."""
        g = _generator(r.row, self.generator)
        drafts = r.draft_token_ids
        q = r.draft_probs
        uniforms = torch.rand(len(drafts), generator=g, dtype=torch.float64).tolist()
        tokens: list[int] = []
        for j, d in enumerate(drafts):
            p_d = float(p[j, d])
            q_d = 1.0 if q is None else float(q[j, d])
            if uniforms[j] * q_d < p_d:  # u < p / q, without dividing by a tiny q
                tokens.append(d)
                continue
            if q is None:
                residual = p[j].clone()
                residual[d] = 0.0
            else:
                residual = (p[j] - q[j].to(p.dtype)).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:
                residual = p[j]  # p == q up to rounding: any draw from p is right
            tokens.append(_draw(residual, g))
            return tokens
        tokens.append(_draw(p[len(drafts)], g))
        return tokens
