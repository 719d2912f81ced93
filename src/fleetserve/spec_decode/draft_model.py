"""Draft-model proposals: a smaller model with the target's tokenizer drafts K tokens.

The draft model keeps its own paged K/V cache with the same block ids as the target's
(each request's blocks hold both models' K/V at the same positions), so it needs no
bookkeeping of its own beyond how many of a request's positions hold valid draft K/V.
Proposing for a sequence of L verified tokens:

    positions:  0 ........ valid-1 | valid ... L-1 | L ...... L+k-2
    step 0:     (kept from before)   one forward     -> d_1
    steps 1..:                                        d_1 .. d_{k-1} in, one a step
                                                      -> d_2 .. d_k

Draft K/V at L .. L+k-2 (the scheduler reserved slots for them: num_lookahead_tokens)
stay valid for the drafts the target accepts; the next proposal starts at the first
position whose token differs from what the draft model saw there.
"""

from __future__ import annotations

import dataclasses

import torch

from fleetserve.config import EngineConfig, ModelConfig
from fleetserve.forward_context import set_forward_context
from fleetserve.layers.sampler import SamplingRow, filter_logits
from fleetserve.models.loader import ModelSource, resolve_model
from fleetserve.spec_decode.base import Proposal, ProposalRequest
from fleetserve.worker.attn_metadata import build_attention_metadata
from fleetserve.worker.model_setup import (
    bind_decode_plan,
    bind_kv_caches,
    fused_decode_enabled,
    load_model,
    pack_for_cpu,
    use_cpu_kernel,
)

_FIELD = "speculative_config.model"


def draft_model_config(config: EngineConfig, source: ModelSource) -> ModelConfig:
    return ModelConfig.from_hf(
        source.hf_config, dtype=config.model.dtype, max_model_len=config.model.max_model_len
    )


def check_draft_model(config: EngineConfig, target: ModelSource) -> ModelConfig:
    """Refuse a draft model whose token ids would mean other tokens than the target's;
    the draft's ModelConfig when it can serve."""
    spec = config.speculative
    assert spec is not None and spec.model is not None
    if config.parallel.world_size > 1:
        raise ValueError(
            f"{_FIELD}: a draft model runs only without tensor/pipeline parallelism "
            "(use method 'ngram' there)"
        )
    try:
        draft = resolve_model(spec.model)
        dcfg = draft_model_config(config, draft)
    except (OSError, ValueError) as e:
        raise ValueError(f"{_FIELD}: cannot load the draft model {spec.model!r}: {e}") from e
    tcfg = config.model
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(
            f"{_FIELD}: the draft model's vocab_size {dcfg.vocab_size} differs from the "
            f"target's {tcfg.vocab_size}; they must share a tokenizer"
        )
    from fleetserve.tokenizer import Tokenizer

    t_vocab = Tokenizer.from_source(target).hf.get_vocab()
    d_vocab = Tokenizer.from_source(draft).hf.get_vocab()
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))[:3]
        raise ValueError(
            f"{_FIELD}: the draft model's tokenizer differs from the target's "
            f"(e.g. {differ}); they must share a tokenizer"
        )
    return dcfg


def with_draft_kv_budget(config: EngineConfig, draft: ModelConfig) -> EngineConfig:
    """`config` whose KV budget also holds the draft's cache: the draft keeps K/V for the
    same block ids in the target's cache dtype (EngineConfig.kv_dtype)."""
    per_token = draft.kv_bytes_per_token_in(config.kv_dtype)
    cache = dataclasses.replace(config.cache, draft_kv_bytes_per_token=per_token)
    return dataclasses.replace(config, cache=cache)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        source = resolve_model(spec.model)
        mcfg = draft_model_config(config, source)
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.k = spec.num_speculative_tokens
        self.max_model_len = config.scheduler.max_model_len
        self.model = load_model(mcfg, source, self.device)
        self.use_cpu_kernel = use_cpu_kernel(mcfg, self.device, config.attention_backend)
        # The target's cache dtype (bf16 beside bf16 weights or when asked): the draft
        # only proposes, the target verifies, so tokens stay the target's; its bytes are
        # in the KV budget (CacheConfig.draft_kv_bytes_per_token).
        self.kv_caches = bind_kv_caches(
            self.model, num_blocks, self.block_size, config.kv_dtype, self.device,
            self.use_cpu_kernel,
        )  # fmt: skip
        pack_for_cpu(self.model, self.use_cpu_kernel)
        # The draft's steps (its prompt catch-up and k one-row proposals) through the C
        # step too, where it applies (models/llama_decode.py).
        self.fused_decode = bind_decode_plan(
            self.model, self.use_cpu_kernel, fused_decode_enabled()
        )
        self.generator = torch.Generator()
        self.generator.manual_seed(config.seed + 1)
        # Per request: the tokens whose K/V the draft cache holds, position by position
        # (verified ones, then the drafts fed back in while proposing), and the blocks
        # they were written to (a block given back and replaced holds someone else's).
        self._seen: dict[str, tuple[list[int], list[int]]] = {}

    def note_step(self, num_rows: int, decodes_only: bool) -> None:
        pass  # the draft model's k is fixed

    def forget(self, req_id: str) -> None:
        self._seen.pop(req_id, None)

    def _num_valid(self, r: ProposalRequest) -> int:
        """Leading positions whose draft K/V were computed from the tokens there now."""
        seen, blocks = self._seen.get(r.req_id, ([], []))
        n = min(len(seen), len(r.token_ids) - 1)  # the last token is always fed again
        same_blocks = next(
            (b for b, (x, y) in enumerate(zip(blocks, r.block_ids, strict=False)) if x != y),
            min(len(blocks), len(r.block_ids)),
        )
        n = min(n, same_blocks * self.block_size)
        for i in range(n):
            if seen[i] != r.token_ids[i]:
                return i
        return n

    def _num_drafts(self, r: ProposalRequest) -> int:
        length = len(r.token_ids)
        # Draft j is fed back at position length - 1 + j: those slots must be the
        # request's, and the target verifies drafts at positions < max_model_len.
        room = len(r.block_ids) * self.block_size - length + 1
        return max(0, min(self.k, self.max_model_len - length, room))

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        ks = [self._num_drafts(r) for r in requests]
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Step 0: each active request catches up from its first stale position.
        starts = {i: self._num_valid(requests[i]) for i in active}
        feeds = {i: requests[i].token_ids[starts[i] :] for i in active}
        for step in range(max(ks, default=0)):
            live = [i for i in active if len(drafts[i]) < ks[i]]
            if not live:
                break
            if step > 0:
                starts = {i: len(requests[i].token_ids) - 1 + step for i in live}
                feeds = {i: [drafts[i][-1]] for i in live}
            tokens = self._forward_and_draw(requests, live, starts, feeds, step)
            for i, (tok, p) in zip(live, tokens, strict=True):
                drafts[i].append(tok)
                if p is not None:
                    probs[i].append(p)
        for i in active:
            r = requests[i]
            # Positions fed: the verified tokens and all drafts but the last.
            self._seen[r.req_id] = (r.token_ids + drafts[i][:-1], list(r.block_ids))
        return [
            Proposal(drafts[i], torch.stack(probs[i]) if probs[i] else None)
            for i in range(len(requests))
        ]

    def _forward_and_draw(
        self,
        requests: list[ProposalRequest],
        live: list[int],
        starts: dict[int, int],
        feeds: dict[int, list[int]],
        step: int,
    ) -> list[tuple[int, torch.Tensor | None]]:
        """One draft forward over each live request's fed tokens; a token drawn from the
        last row of each (with its distribution, or None for greedy)."""
        # Decodes (one token after some context) first, as the attention layer expects.
        order = sorted(live, key=lambda i: not (len(feeds[i]) == 1 and starts[i] > 0))
        num_decodes = sum(1 for i in order if len(feeds[i]) == 1 and starts[i] > 0)
        meta, pos_t = build_attention_metadata(
            [requests[i].block_ids for i in order],
            [starts[i] for i in order],
            [len(feeds[i]) for i in order],
            num_decodes,
            self.block_size,
            self.device,
            self.use_cpu_kernel,
        )
        ids = [t for i in order for t in feeds[i]]
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        with set_forward_context(meta):
            hidden = self.model(x, pos_t)
        last_rows = [end - 1 for end in meta.query_start_loc[1:]]
        logits = self.model.compute_logits(hidden[last_rows]).float()
        picked: dict[int, tuple[int, torch.Tensor | None]] = {}
        for row, i in enumerate(order):
            params = requests[i].params
            if params.greedy:
                picked[i] = (int(logits[row].argmax()), None)
                continue
            q = filter_logits(logits[row : row + 1], [SamplingRow(params, [], [])]).softmax(-1)[0]
            g = self.generator
            if params.seed is not None:
                g = torch.Generator()
                pos = len(requests[i].token_ids) + step
                g.manual_seed(hash((params.seed, pos, 2)) & 0x7FFF_FFFF_FFFF_FFFF)
            noise = torch.empty_like(q).exponential_(generator=g)
            picked[i] = (int((q / noise).argmax()), q)
        return [picked[i] for i in live]
