"""A lone greedy stream decodes several tokens per scheduler step: a burst.

Why: one stream's decode token is ~4-5 ms of C step and ~0.5 ms of Python around it (the
scheduler, the runner's metadata and sampling, the engine's outputs). When a step holds
one request, decoding with nothing that reads its logits but their argmax (which the C
step finds), the runner has the C step run again on the token just found, at the next
position, while the request's blocks hold a slot for it, all in one C call
(`DecodePlan.burst`), and returns all the tokens; the scheduler counts their K/V as
computed (`Scheduler.update_from_output`). A loop of Python calls cost ~0.25 ms a token
(1 thread: each call right after a step's weights went through the caches is slow).

The tokens are the ones one step at a time gives: each extra step is the same C step on
the inputs the scheduler's next step would build (the token's embedding through the
model's own lookup code, its position, slot and block table; tests/test_decode_burst.py).
A burst stops at the request's stop tokens and lengths (the scheduler drops anything
after a stop it finds itself, as for accepted drafts), and never starts after a
prefill: the first token leaves with the step that computed it.
"""

from __future__ import annotations

import os

import torch

from fleetserve.kernels.decode_step import BurstInput, DecodePlan
from fleetserve.kernels.quant import QuantWeight
from fleetserve.layers.quant_linear import QuantEmbedding
from fleetserve.models.llama import LlamaModel


class DecodeBurst:
    """Runs the extra steps of a burst for a model whose C step has the LM head and its
    argmax (`plan.vocab` > 0), embedding through `table` (its embedding's weight: GGUF
    blocks or float32 rows); `max_tokens`: the most tokens one scheduler step returns."""

    def __init__(
        self,
        plan: DecodePlan,
        table: QuantWeight | torch.Tensor,
        block_size: int,
        max_model_len: int,
        max_tokens: int,
    ) -> None:
        if max_tokens < 2:
            raise ValueError(f"a burst decodes at least 2 tokens, got max_tokens={max_tokens}")
        if not plan.vocab:
            raise ValueError("a burst needs the C step with the LM head")
        self.plan = plan
        self._input = BurstInput(plan, table)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        # Tokens decoded by bursts past each step's first (tests, benches).
        self.num_extra_tokens = 0

    def num_extra(
        self,
        num_computed: int,
        num_blocks: int,
        num_output: int,
        max_tokens: int | None,
    ) -> int:
        """How many tokens may follow this step's one, for a request with `num_computed`
        tokens in the cache before the step (its pending token at that position),
        `num_blocks` blocks and `num_output` output tokens after the step's token."""
        c = num_computed
        # Extra step j writes position c + j: a slot of the request's own blocks.
        extra = min(self.max_tokens - 1, num_blocks * self.block_size - c - 1)
        extra = min(extra, self.max_model_len - c - 2)  # its tokens stay within the model
        if max_tokens is not None:
            extra = min(extra, max_tokens - num_output)
        return max(extra, 0)

    def run(
        self,
        token: int,
        num_computed: int,
        block_ids: list[int],
        num_extra: int,
        stop_ids: frozenset[int],
    ) -> list[int]:
        """The tokens after `token` (the step's own, sampled at position num_computed),
        at most `num_extra`, stopping after one in `stop_ids` (not fed back)."""
        if num_extra < 1 or token in stop_ids:
            return []
        out = self.plan.burst(
            self._input,
            token,
            num_computed + 1,
            torch.tensor(block_ids, dtype=torch.int64),
            num_extra,
            torch.tensor(sorted(stop_ids), dtype=torch.int64),
        )
        self.num_extra_tokens += len(out)
        return out


# The most tokens a burst returns by default (FLEETSERVE_DECODE_BURST overrides; 1 turns
# bursts off): 8 measured best, -14% CPU a token for one stream; a burst holds the engine
# for that many C steps (~35 ms on SmolLM2 at one thread), which a request arriving
# meanwhile waits out. (Opt-in for a while: tests/serve/test_resume.py's stop-string case
# failed with them on, because a burst ended the request in its second output and the
# test resumed from that finished output, which hung: such a resume is now refused.)
DEFAULT_BURST_TOKENS = 8


def make_decode_burst(model: object, block_size: int, max_model_len: int) -> DecodeBurst | None:
    """The runner's burst for `model` (its `LlamaForCausalLM.model`), or None: a model
    outside it (another embedding than Llama's GGUF or float32 table, no C step with the
    head), FLEETSERVE_DECODE_BURST <= 1 (tokens per burst; A/B runs) or a debug step
    delay."""
    raw = os.environ.get("FLEETSERVE_DECODE_BURST", str(DEFAULT_BURST_TOKENS))
    try:
        tokens = int(raw)
    except ValueError:
        raise ValueError(f"FLEETSERVE_DECODE_BURST must be an integer, got {raw!r}") from None
    if tokens <= 1:
        return None
    found = burst_plan(model)
    if found is None:
        return None
    plan, table = found
    return DecodeBurst(plan, table, block_size, max_model_len, tokens)


def burst_plan(model: object) -> tuple[DecodePlan, QuantWeight | torch.Tensor] | None:
    """The C step (with its LM head) and the embedding table a burst of `model` (its
    `LlamaForCausalLM.model`) runs on, or None: another model, another embedding than
    Llama's GGUF or float32 table, no C step with the head, or a debug step delay."""
    if type(model) is not LlamaModel:
        return None
    # FLEETSERVE_DEBUG_STEP_DELAY_S (engine/core_proc.py) slows every step to stand for a
    # slow engine (chaos and drain tests keep streams in flight with it): a burst would
    # run eight tokens behind one delay, so none runs under it.
    if os.environ.get("FLEETSERVE_DEBUG_STEP_DELAY_S"):
        return None
    plan = model.decode_plan
    if plan is None or not plan.vocab:
        return None
    # The tables embed_rows reads as the burst does (LlamaModel.forward's lookup).
    embed = model.embed_tokens
    table: QuantWeight | torch.Tensor
    if isinstance(embed, QuantEmbedding):
        table = embed.weight_q
    elif type(embed) is torch.nn.Embedding and embed.weight.dtype == torch.float32:
        table = embed.weight.detach()
        if not table.is_contiguous():
            return None
    else:
        return None
    return plan, table
