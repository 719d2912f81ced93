"""A lone greedy stream decodes several tokens per scheduler step: a burst.

Why: one stream's decode token is ~4-5 ms of C step and ~0.5 ms of Python around it (the
scheduler, the runner's metadata and sampling, the engine's outputs). When a step holds
one request, decoding with nothing that reads its logits but their argmax (which the C
step finds), the runner runs the C step again on the token just found, at the next
position, while the request's blocks hold a slot for it, and returns all the tokens;
the scheduler counts their K/V as computed (`Scheduler.update_from_output`). Each extra
token then costs one C step and the few Python calls below.

The tokens are the ones one step at a time gives: each extra step is the same C step on
the inputs the scheduler's next step would build (the token's embedding through the
model's own lookup, its position, slot and block table; tests/test_decode_burst.py).
A burst stops at the request's stop tokens and lengths (the scheduler drops anything
after a stop it finds itself, as for accepted drafts), and never starts after a
prefill: the first token leaves with the step that computed it.
"""

from __future__ import annotations

import os

import torch

from fleetserve.kernels.decode_step import DecodePlan
from fleetserve.models.llama import LlamaModel, embed_rows


class DecodeBurst:
    """Runs the extra steps of a burst for a model whose C step has the LM head and its
    argmax (`plan.vocab` > 0); `max_tokens`: the most tokens one scheduler step returns."""

    def __init__(self, model: LlamaModel, block_size: int, max_model_len: int, max_tokens: int):
        if max_tokens < 2:
            raise ValueError(f"a burst decodes at least 2 tokens, got max_tokens={max_tokens}")
        plan = model.decode_plan
        if plan is None or not plan.vocab:
            raise ValueError("a burst needs the C step with the LM head")
        self.plan: DecodePlan = plan
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        # Tokens decoded by bursts past each step's first (tests, benches).
        self.num_extra_tokens = 0
        self._rows = torch.zeros(1, dtype=torch.int64)
        self._logits = torch.empty(1, plan.vocab)
        self._argmax = torch.empty(1, dtype=torch.int64)
        self._ids = torch.empty(1, dtype=torch.int64)

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
        out: list[int] = []
        if num_extra < 1 or token in stop_ids:
            return out
        bs = self.block_size
        # The step's int64 metadata in one tensor, as the runner builds it: position,
        # slot block, slot offset [1]; q_starts, q_lens, seq_lens [1]; the block table.
        meta = torch.tensor([0, 0, 0, 0, 1, 0, *block_ids], dtype=torch.int64)
        m = meta.numpy()
        pos_t, blk_t, off_t = meta[0:1], meta[1:2], meta[2:3]
        qs_t, ql_t, sl_t, table_t = meta[3:4], meta[4:5], meta[5:6], meta[6:].view(1, -1)
        ids = self._ids.numpy()
        for j in range(1, num_extra + 1):
            pos = num_computed + j
            m[0], m[1], m[2], m[5] = pos, block_ids[pos // bs], pos % bs, pos + 1
            ids[0] = token
            x = embed_rows(self.model.embed_tokens, self._ids)
            self.plan.run(
                x, pos_t, blk_t, off_t, qs_t, ql_t, sl_t, table_t, None, None,
                self._rows, self._logits, self._argmax,
            )  # fmt: skip
            token = int(self._argmax[0])
            out.append(token)
            if token in stop_ids:
                break
        self.num_extra_tokens += len(out)
        return out


# The most tokens a burst returns by default: a burst holds the engine for that many
# C steps (~35 ms on SmolLM2), which a request arriving meanwhile waits out.
DEFAULT_BURST_TOKENS = 8


def make_decode_burst(model: object, block_size: int, max_model_len: int) -> DecodeBurst | None:
    """The runner's burst for `model` (its `LlamaForCausalLM.model`), or None: a model
    outside it (another embedding than Llama's, no C step with the head) or
    FLEETSERVE_DECODE_BURST <= 1 (tokens per burst; A/B runs)."""
    raw = os.environ.get("FLEETSERVE_DECODE_BURST", str(DEFAULT_BURST_TOKENS))
    try:
        tokens = int(raw)
    except ValueError:
        raise ValueError(f"FLEETSERVE_DECODE_BURST must be an integer, got {raw!r}") from None
    plan = getattr(model, "decode_plan", None)
    if tokens <= 1 or type(model) is not LlamaModel or plan is None or not plan.vocab:
        return None
    return DecodeBurst(model, block_size, max_model_len, tokens)
