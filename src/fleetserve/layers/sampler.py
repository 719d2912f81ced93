"""Batched sampling: penalties, greedy, temperature, top-k, top-p, min-p, logprobs.

Logprobs are those of the raw model distribution (before penalties and temperature),
as OpenAI and vLLM report them. A seeded request draws its randomness from a generator
seeded by (seed, output position), so its tokens do not depend on the rest of the
batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fleetserve.core.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()


def _row_generator(params: SamplingParams, position: int) -> torch.Generator | None:
    if params.seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(hash((params.seed, position)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        sp = row.params
        if not sp.needs_penalties:
            continue
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
            )
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty
            )
        if row.output_token_ids and (sp.presence_penalty or sp.frequency_penalty):
            out = torch.tensor(row.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]].float()
            logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    return logits


def apply_token_bitmask(
    logits: torch.Tensor, logit_rows: list[int], bias: Any, mask_rows: list[int] | None = None
) -> None:
    """Structured outputs: adds row `mask_rows[j]` (default j) of `bias` (float32 numpy, 0
    for an allowed token, -inf for a forbidden one; core/structured.bitmask_bias) to row
    `logit_rows[j]` of `logits`, in place. Tokens past the mask's vocabulary (a padded LM
    head) are forbidden too.

    Row by row in numpy, on this thread: a torch add over the whole block is an OpenMP
    region whose barrier waits for a partner thread a busy machine has descheduled
    (measured 0.2 ms on one thread, 1.4-6 ms on two, for 16 x 49k logits)."""
    if not logit_rows:
        return
    vocab = logits.shape[1]
    width = min(vocab, bias.shape[1])
    picks = list(range(len(logit_rows))) if mask_rows is None else mask_rows
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        add = torch.from_numpy(bias[picks, :width])
        idx = torch.tensor(logit_rows, dtype=torch.long)
        logits[idx, :width] += add.to(logits.dtype)
        logits[idx, width:] = float("-inf")
        return
    out = logits.numpy()
    for r, m in zip(logit_rows, picks, strict=True):
        row = out[r]
        np.add(row[:width], bias[m, :width], out=row[:width])
        if width < vocab:
            row[width:] = -np.inf


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Before min_tokens outputs, EOS and stop_token_ids cannot be sampled (vLLM's rule):
    merely not stopping on them would leave them inside the output. A row a grammar has
    already cut down to those tokens keeps them: the grammar wins over min_tokens."""
    for i, row in enumerate(rows):
        sp = row.params
        if len(row.output_token_ids) >= sp.min_tokens:
            continue
        banned = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            banned.update(row.eos_token_ids)
        if banned:
            ids = sorted(banned)
            kept = logits[i].clone()
            kept[ids] = float("-inf")
            if sp.structured_outputs is None or bool(torch.isfinite(kept).any()):
                logits[i] = kept
    return logits


def filter_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (to -inf). logits: [B, V]."""
    vocab = logits.shape[1]
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        k = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(before >= p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        floor = (
            torch.tensor(min_p, dtype=probs.dtype).unsqueeze(1)
            * probs.max(dim=-1, keepdim=True).values
        )
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        argmax: torch.Tensor | None = None,
    ) -> tuple[list[int], list[dict[int, float]] | None]:
        """logits: [num_rows, vocab] float32; argmax: their rows' argmax if already
        known (the C step's head finds it), int64 [num_rows]. Returns token ids and
        per-row logprobs."""
        want_lp = [r.params.logprobs for r in rows]
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_lp) else None
        )
        if any(r.params.needs_penalties for r in rows):
            logits = apply_penalties(logits.clone(), rows)
            argmax = None
        if any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
            logits = apply_min_tokens(logits.clone(), rows)
            argmax = None
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if argmax is None:
            tokens = argmax_rows(logits)
        else:  # written to below only when some row samples
            tokens = argmax.clone() if random_idx else argmax
        if random_idx:
            sub_rows = [rows[i] for i in random_idx]
            probs = filter_logits(logits[random_idx], sub_rows).softmax(dim=-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
            noise = torch.empty_like(probs)
            for j, row in enumerate(sub_rows):
                g = _row_generator(row.params, len(row.output_token_ids)) or self.generator
                noise[j].exponential_(generator=g)
            tokens[random_idx] = argmax_rows(probs / noise)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, None
        out: list[dict[int, float]] = []
        for i, n in enumerate(want_lp):
            if n is None:
                out.append({})
                continue
            out.append(top_logprobs(raw_logprobs[i], token_list[i], n))
        return token_list, out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first maximum, as torch's), through numpy for float32 on CPU.

    torch's CPU argmax over a [rows, vocab] float32 tensor runs 3-10 ms for 16 rows of
    49,152 on this 2-core machine (its OpenMP threads contend with the step's), numpy's
    0.4 ms; both return the first maximal index (NaN counting as the maximum).
    """
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1).astype(np.int64))
    return x.argmax(dim=-1)


def top_logprobs(row_logprobs: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    """The chosen token's logprob first, then the top-n alternatives."""
    lps = {token_id: float(row_logprobs[token_id])}
    if n > 0:
        vals, ids = row_logprobs.topk(n)
        for t, v in zip(ids.tolist(), vals.tolist(), strict=True):
            if v != float("-inf"):  # a token a grammar forbids is no alternative
                lps.setdefault(t, v)
    return lps
