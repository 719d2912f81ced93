"""Runs one scheduler step on the model: flattened batch in, sampled tokens out.

The runner mirrors the scheduler's view of each running request (token ids, block ids,
computed count), updated from the diffs in each SchedulerOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fleetserve.config import EngineConfig
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, SpecBurstTally
from fleetserve.core.structured import GrammarBitmask
from fleetserve.distributed.parallel_state import ParallelContext
from fleetserve.forward_context import AttentionMetadata, set_forward_context
from fleetserve.layers.sampler import Sampler, SamplingRow, apply_token_bitmask, top_logprobs
from fleetserve.lora.context import set_lora_rows
from fleetserve.lora.slots import LoRASlots
from fleetserve.models.loader import ModelSource
from fleetserve.spec_decode.base import Proposal, ProposalRequest, Proposer
from fleetserve.spec_decode.rejection_sampler import DraftedRow, RejectionSampler
from fleetserve.worker.attn_metadata import build_attention_metadata, build_cpu_metadata
from fleetserve.worker.block_table import BlockTable
from fleetserve.worker.decode_burst import DecodeBurst, make_decode_burst
from fleetserve.worker.model_setup import (
    bind_decode_plan,
    bind_kv_caches,
    fused_decode_enabled,
    load_model,
    pack_for_cpu,
    use_cpu_kernel,
)
from fleetserve.worker.spec_burst import SpecBurst, make_spec_burst

# Decodes attended in one padded SDPA call at most (sorted by length first).
DECODE_GROUP_SIZE = 16


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    # The sliding-window layers' own blocks (a model with local and global layers).
    window_block_ids: list[int] | None = None
    lora_name: str | None = None
    # The distribution the pending drafts were drawn from ([k, vocab]; None: a point mass).
    draft_probs: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        p = self.params
        # Greedy with nothing that changes the logits: its token is the logits' argmax.
        self._plain_greedy = p.greedy and not p.needs_penalties and p.logprobs is None

    @property
    def plain_greedy(self) -> bool:
        """Whether this step's token is the argmax of the raw logits (min_tokens, if any,
        already reached), no logprobs wanted: the sampler would return just that."""
        num_out = len(self.token_ids) - self.num_prompt_tokens
        return self._plain_greedy and num_out >= self.params.min_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        """The token ids that end the request: its stop_token_ids, and its EOS ids unless
        ignore_eos (what the drafters and bursts stop at)."""
        p = self.params
        return frozenset(p.stop_token_ids or ()) | frozenset(
            () if p.ignore_eos else self.eos_token_ids
        )

    def sampling_row(self) -> SamplingRow:
        n = self.num_prompt_tokens
        return SamplingRow(self.params, self.token_ids[:n], self.token_ids[n:], self.eos_token_ids)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        num_blocks: int,
        parallel: ParallelContext | None = None,
    ) -> None:
        """`parallel`: this rank's place in a TP x PP replica; None runs the whole model."""
        self.config = config
        self.parallel = parallel
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        mcfg = config.model
        t0 = time.perf_counter()
        self.model = load_model(
            mcfg, source, self.device, parallel, config.quantization, config.int8_activations
        )
        self.load_seconds = time.perf_counter() - t0
        self.num_blocks = num_blocks
        self.use_cpu_kernel = use_cpu_kernel(mcfg, self.device, config.attention_backend)
        if config.attention_backend == "cpu" and not self.use_cpu_kernel:
            raise ValueError(
                "attention_backend='cpu' needs a float32 model on the CPU and a C compiler"
            )
        # A model with local and global layers: the local ones' own pool (0: none).
        self.num_sliding_blocks = config.cache.resolve_sliding_blocks(
            mcfg, config.scheduler, num_blocks
        )
        self.kv_caches = bind_kv_caches(
            self.model,
            num_blocks,
            self.block_size,
            config.kv_dtype,
            self.device,
            self.use_cpu_kernel,
            self.num_sliding_blocks,
        )
        self.sampler = Sampler(config.seed)
        pack_for_cpu(self.model, self.use_cpu_kernel, config.bf16_weights)
        # Under TP / PP each rank's plan runs its shard (llama_decode.py).
        self.fused_decode = bind_decode_plan(
            self.model, self.use_cpu_kernel, fused_decode_enabled()
        )
        # LoRA: the projections wrapped after the decode plan took the base modules; the
        # plan then takes the slots too (lora/fused.py), adapter rows staying in the C step
        # (in one process; under TP / PP steps with adapter rows take the module path).
        self.lora = (
            LoRASlots(self.model, config.lora, parallel, self.device) if config.lora else None
        )
        if self.lora is not None and self.fused_decode and parallel is None:
            self.lora.bind_decode_step(self.model)
        # The C step's head also finds each row's argmax when that is the logits' argmax.
        head_exact = getattr(self.model, "head_argmax_exact", None)
        self.head_argmax = bool(head_exact and head_exact())
        # A lone greedy stream's steps decode several tokens (worker/decode_burst.py).
        self.burst: DecodeBurst | None = None
        if (
            self.head_argmax
            and parallel is None
            and config.speculative is None
            and config.lora is None
            and not self.num_sliding_blocks
        ):
            self.burst = make_decode_burst(
                self.model.model, self.block_size, config.scheduler.max_model_len
            )
        # Its speculative steps verify on in C (worker/spec_burst.py).
        self.spec_burst: SpecBurst | None = None
        if (
            self.head_argmax
            and parallel is None
            and config.lora is None
            and not self.num_sliding_blocks
        ):
            self.spec_burst = make_spec_burst(
                self.model.model, config.speculative, config.scheduler.max_model_len
            )
        self.requests: dict[str, RequestState] = {}
        # The requests' block ids as numpy rows, from which the C kernels' metadata is
        # gathered each step (and the sliding-window layers' own, where they have some).
        self.block_table = BlockTable()
        self.window_table = BlockTable() if self.num_sliding_blocks else None
        self.forward_steps = 0  # model forwards run (beside the plan's C steps)
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.proposer: Proposer | None = None
        if config.speculative is not None:
            from fleetserve.spec_decode.proposers import make_proposer

            self.proposer = make_proposer(config, num_blocks)

    # ------------------------------------------------------------ state diffs
    def _update_states(self, so: SchedulerOutput) -> None:
        tables = [t for t in (self.block_table, self.window_table) if t is not None]
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            for t in tables:
                t.remove(req_id)
            if self.proposer is not None:
                self.proposer.forget(req_id)
        for new in so.scheduled_new_reqs:
            if self.proposer is not None:
                self.proposer.forget(new.req_id)
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_ids=new.eos_token_ids,
                window_block_ids=None
                if new.window_block_ids is None
                else list(new.window_block_ids),
                lora_name=new.lora_name,
            )
            self.block_table.add(new.req_id, new.block_ids)
            if self.window_table is not None:
                self.window_table.add(new.req_id, new.window_block_ids or [])
        for cached in so.scheduled_cached_reqs:
            rid = cached.req_id
            st = self.requests[rid]
            st.token_ids.extend(cached.new_token_ids)
            # The table's row changes only with the block list (a decode inside its last
            # block changes neither).
            kept, new_ids = cached.num_kept_block_ids, cached.new_block_ids
            if (kept is not None and kept < len(st.block_ids)) or new_ids:
                if kept is not None:
                    del st.block_ids[kept:]
                self.block_table.extend(rid, len(st.block_ids), new_ids)
                st.block_ids.extend(new_ids)
            if st.window_block_ids is not None:
                kept_w = cached.num_kept_window_block_ids
                new_w = cached.new_window_block_ids or []
                if (kept_w is not None and kept_w < len(st.window_block_ids)) or new_w:
                    if kept_w is not None:
                        del st.window_block_ids[kept_w:]
                    if self.window_table is not None:
                        self.window_table.extend(rid, len(st.window_block_ids), new_w)
                    st.window_block_ids.extend(new_w)
            st.num_computed_tokens = cached.num_computed_tokens

    # ---------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        sched = so.num_scheduled_tokens
        spec = so.scheduled_spec_decode_tokens
        states = [self.requests[r] for r in sched]
        # Decodes first: they are attended together in one padded batch. A request with
        # drafts attends like a prefill chunk after its context.
        decodes = [s for s in states if sched[s.req_id] == 1 and s.num_computed_tokens > 0]
        # Sorted by length, decodes are padded in small groups of similar lengths: less
        # padding to gather and attend than one group padded to the longest.
        decodes.sort(key=lambda s: s.num_computed_tokens)
        prefills = [s for s in states if not (sched[s.req_id] == 1 and s.num_computed_tokens > 0)]
        ordered = decodes + prefills

        input_ids: list[int] = []
        ctx_lens = [s.num_computed_tokens for s in ordered]
        q_lens = [sched[s.req_id] for s in ordered]
        for s, c, n in zip(ordered, ctx_lens, q_lens, strict=True):
            drafts = spec.get(s.req_id)
            if drafts:
                input_ids.extend(s.token_ids[c:] + drafts)
            else:
                input_ids.extend(s.token_ids[c : c + n])
        if self.use_cpu_kernel:
            nd = len(decodes)
            meta, pos_t = self._cpu_metadata(self.block_table, ordered, ctx_lens, q_lens, nd)
            if self.window_table is not None:
                w = self.window_table
                meta.sliding, _ = self._cpu_metadata(w, ordered, ctx_lens, q_lens, nd)
        else:

            def torch_metadata(tables: list[list[int]]) -> tuple[AttentionMetadata, torch.Tensor]:
                return build_attention_metadata(
                    tables, ctx_lens, q_lens, len(decodes), self.block_size, self.device,
                    False, DECODE_GROUP_SIZE,
                )  # fmt: skip

            meta, pos_t = torch_metadata([s.block_ids for s in ordered])
            if self.num_sliding_blocks:
                # The sliding-window layers' slots and tables (same positions).
                meta.sliding, _ = torch_metadata([s.window_block_ids or [] for s in ordered])
        dev = self.device
        x = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pp = self.parallel
        if pp is not None and not pp.is_first_stage:
            # A later stage starts from the previous stage's hidden states, not token ids.
            mcfg = self.config.model
            x = pp.recv_prev((len(input_ids), mcfg.hidden_size), mcfg.dtype, dev)
        lora_groups = None
        if self.lora is not None:
            row_adapters: list[str | None] = []
            for s, n in zip(ordered, q_lens, strict=True):
                row_adapters.extend([s.lora_name] * n)
            lora_groups = self.lora.prepare(row_adapters)
        last_stage = pp is None or pp.is_last_stage
        qsl = meta.query_start_loc
        picks = _sampled_rows(ordered, qsl, meta.seq_lens, spec)
        if last_stage:
            meta.logit_rows = picks.rows  # the C step's LM head computes these
            # and their argmax (greedy rows' tokens), unless all go to the verifier
            meta.want_head_argmax = self.head_argmax and bool(picks.plain or picks.verify)
            # Only a prompt's logprobs read hidden states past the sampled rows.
            meta.sampled_rows_only = all(s.params.prompt_logprobs is None for s in prefills)
        with set_forward_context(meta), set_lora_rows(lora_groups):
            hidden = self.model(x, pos_t)
        self.forward_steps += 1
        if not last_stage:
            assert pp is not None
            pp.send_next(hidden)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        if self.proposer is not None:
            # Steps of decodes and verifications only (no new request, no prefill rows):
            # an adaptive proposer times them by rows.
            self.proposer.note_step(
                len(input_ids), not so.scheduled_new_reqs and len(picks.rows) == len(input_ids)
            )
        sampled, lp_by_req = self._sample(
            picks, hidden, meta.head_logits, so.grammar_bitmask, meta.head_argmax
        )
        if (
            self.burst is not None
            and len(ordered) == len(decodes) == 1
            and not spec
            and so.grammar_bitmask is None
            and meta.head_argmax is not None
            and decodes[0].plain_greedy
            and decodes[0].params.structured_outputs is None
        ):
            self._burst(decodes[0], sampled[decodes[0].req_id])
        bursts: dict[str, SpecBurstTally] = {}
        if (
            self.spec_burst is not None
            and len(ordered) == 1
            and so.grammar_bitmask is None
            and meta.head_argmax is not None
        ):
            tokens = sampled.get(ordered[0].req_id)
            tally = self.spec_burst.extend(ordered[0], tokens) if tokens else None
            if tally is not None:
                bursts[ordered[0].req_id] = tally
        prompt_lps = self._prompt_logprobs(ordered, qsl, ctx_lens, hidden)
        req_ids = list(sched)
        want_logprobs = any(s.params.logprobs is not None for s in ordered)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=[lp_by_req.get(r, []) for r in req_ids] if want_logprobs else None,
            prompt_logprobs=prompt_lps,
            spec_token_ids=self._propose(req_ids, sampled) if self.proposer is not None else None,
            spec_bursts=bursts,
        )

    def _burst(self, s: RequestState, tokens: list[int]) -> None:
        """Appends to `tokens` (the step's one, greedy) the tokens a burst decodes after
        it, as later steps would."""
        assert self.burst is not None
        p = s.params
        num_output = len(s.token_ids) + len(tokens) - s.num_prompt_tokens
        extra = self.burst.num_extra(
            s.num_computed_tokens, len(s.block_ids), num_output, p.max_tokens
        )
        if extra:
            tokens += self.burst.run(
                tokens[-1], s.num_computed_tokens, s.block_ids, extra, s.stop_ids
            )

    def _cpu_metadata(
        self,
        table: BlockTable,
        ordered: list[RequestState],
        ctx_lens: list[int],
        q_lens: list[int],
        num_decodes: int,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        row_of = table.rows
        rows = np.array([row_of[s.req_id] for s in ordered], dtype=np.int64)
        return build_cpu_metadata(table, rows, ctx_lens, q_lens, num_decodes, self.block_size)

    def path_counts(self) -> dict[str, int]:
        """Model forwards run, how many of them the C step took and in how many it ran
        the LM head too."""
        plan = getattr(self.model.model, "decode_plan", None)
        return {
            "forward_steps": self.forward_steps,
            "c_steps": plan.steps if plan else 0,
            "c_head_steps": plan.head_steps if plan else 0,
        }

    def _sample(
        self,
        picks: SampledRows,
        hidden: torch.Tensor,
        head_logits: torch.Tensor | None,
        grammar: GrammarBitmask | None = None,
        head_argmax: torch.Tensor | None = None,
    ) -> tuple[dict[str, list[int]], dict[str, list[dict[int, float]]]]:
        """Tokens (and logprobs) of each request whose step reaches its end: sampled from
        its last row, or, with drafts, verified against the rows of the pending token and
        of each draft (row j predicts the token after draft j). A constrained request's
        rows lose the tokens its grammar forbids first (so logprobs are those of the
        allowed tokens, as in vLLM). head_logits: the head's output for `picks.rows`
        when the C step computed it (None: computed here from `hidden`); head_argmax:
        its rows' argmax found by the C step (None: not found)."""
        plain, verify, rows = picks.plain, picks.verify, picks.rows
        sampled: dict[str, list[int]] = {}
        lps_out: dict[str, list[dict[int, float]]] = {}
        if not rows:
            return sampled, lps_out
        if head_logits is not None:
            logits = self.model.finish_logits(head_logits)
        else:
            logits = self.model.compute_logits(hidden[rows])
        if grammar is not None:
            logit_rows: list[int] = []
            mask_rows: list[int] = []
            for j, (_, s) in enumerate(plain):
                if s.req_id in grammar.rows:
                    logit_rows.append(j)
                    mask_rows.append(grammar.rows[s.req_id])
            base = len(plain)
            for _, s, d in verify:
                if s.req_id in grammar.rows:
                    first = grammar.rows[s.req_id]
                    logit_rows.extend(range(base, base + len(d) + 1))
                    mask_rows.extend(range(first, first + len(d) + 1))
                base += len(d) + 1
            apply_token_bitmask(logits, logit_rows, grammar.wait(), mask_rows)
            if logit_rows:
                head_argmax = None  # masked: not the argmax of these logits
        if plain and head_argmax is not None and all(s.plain_greedy for _, s in plain):
            # What the sampler would return, without building its rows.
            for (_, s), tok in zip(plain, head_argmax[: len(plain)].tolist(), strict=True):
                sampled[s.req_id] = [tok]
        elif plain:
            argmax = None if head_argmax is None else head_argmax[: len(plain)]
            tokens, lps = self.sampler(
                logits[: len(plain)], [s.sampling_row() for _, s in plain], argmax
            )
            for j, (_, s) in enumerate(plain):
                sampled[s.req_id] = [tokens[j]]
                if lps is not None:
                    lps_out[s.req_id] = [lps[j]]
        if verify:
            drafted = [
                DraftedRow(s.sampling_row(), d, _draft_probs(s, len(d))) for _, s, d in verify
            ]
            argmax_v = None if head_argmax is None else head_argmax[len(plain) :]
            tokens_v, lps_v = self.rejection_sampler(logits[len(plain) :], drafted, argmax_v)
            for j, (_, s, _) in enumerate(verify):
                sampled[s.req_id] = tokens_v[j]
                if lps_v is not None:
                    lps_out[s.req_id] = lps_v[j]
        return sampled, lps_out

    def _propose(self, req_ids: list[str], sampled: dict[str, list[int]]) -> list[list[int]]:
        """Drafts for the next step of each request that got tokens now."""
        assert self.proposer is not None
        asks = []
        for req_id, new in sampled.items():
            s = self.requests[req_id]
            s.draft_probs = None
            if new:
                asks.append(
                    ProposalRequest(req_id, s.token_ids + new, s.block_ids, s.params, s.stop_ids)
                )
        proposals: dict[str, Proposal] = {}
        if asks:
            for ask, prop in zip(asks, self.proposer.propose(asks), strict=True):
                proposals[ask.req_id] = prop
                self.requests[ask.req_id].draft_probs = prop.probs
        return [proposals[r].token_ids if r in proposals else [] for r in req_ids]

    def _prompt_logprobs(
        self,
        ordered: list[RequestState],
        qsl: list[int],
        ctx_lens: list[int],
        hidden: torch.Tensor,
    ) -> dict[str, list[dict[int, float] | None]]:
        """Logprob of each prompt token given the ones before it, chunk by chunk."""
        out: dict[str, list[dict[int, float] | None]] = {}
        for i, s in enumerate(ordered):
            n = s.params.prompt_logprobs
            c = ctx_lens[i]
            if n is None or c >= s.num_prompt_tokens:
                continue
            end = min(qsl[i + 1] - qsl[i], s.num_prompt_tokens - c)
            entries: list[dict[int, float] | None] = [None] if c == 0 else []
            # Position p predicts token p + 1; the last prompt position predicts output.
            last = min(end, s.num_prompt_tokens - 1 - c)
            if last > 0:
                lp = torch.log_softmax(
                    self.model.compute_logits(hidden[qsl[i] : qsl[i] + last]), dim=-1
                )
                for j in range(last):
                    entries.append(top_logprobs(lp[j], s.token_ids[c + j + 1], n))
            out[s.req_id] = entries
        return out


@dataclass(frozen=True)
class SampledRows:
    """The step's rows that get logits: `rows` holds the last row of each request in
    `plain` (its step reaches its end), then the pending token's and each draft's rows of
    each request in `verify` (request index in the batch, state, drafts)."""

    plain: list[tuple[int, RequestState]]
    verify: list[tuple[int, RequestState, list[int]]]
    rows: list[int]


def _sampled_rows(
    ordered: list[RequestState], qsl: list[int], seq_lens: list[int], spec: dict[str, list[int]]
) -> SampledRows:
    plain: list[tuple[int, RequestState]] = []
    verify: list[tuple[int, RequestState, list[int]]] = []
    for i, s in enumerate(ordered):
        drafts = spec.get(s.req_id, [])
        if seq_lens[i] == len(s.token_ids) + len(drafts):
            if drafts:
                verify.append((i, s, drafts))
            else:
                plain.append((i, s))
    rows = [qsl[i + 1] - 1 for i, _ in plain]
    for i, _, d in verify:
        rows.extend(range(qsl[i + 1] - 1 - len(d), qsl[i + 1]))
    return SampledRows(plain, verify, rows)


def _draft_probs(s: RequestState, num_drafts: int) -> torch.Tensor | None:
    """The rows of the distributions the scheduled drafts (a prefix of the proposal)
    were drawn from."""
    return None if s.draft_probs is None else s.draft_probs[:num_drafts]
