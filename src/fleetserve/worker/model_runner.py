"""Runs one scheduler step on the model: flattened batch in, sampled tokens out.

The runner mirrors the scheduler's view of each running request (token ids, block ids,
computed count), updated from the diffs in each SchedulerOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fleetserve.config import EngineConfig
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fleetserve.distributed.parallel_state import ParallelContext
from fleetserve.forward_context import (
    AttentionMetadata,
    DecodeGroup,
    PagedSeqs,
    set_forward_context,
)
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.layers.sampler import Sampler, SamplingRow, top_logprobs
from fleetserve.models.loader import ModelSource
from fleetserve.models.quantize import keep_gguf_quantized, quantize_int8
from fleetserve.models.registry import model_class
from fleetserve.models.sharding import load_shards, shard_model

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
        with torch.device("meta"):
            model = model_class(mcfg)(mcfg)
            if parallel is not None:
                shard_model(model, parallel)
        # Quantized layers are swapped in before allocation: no float32 copy is made.
        consumed = keep_gguf_quantized(model, source) if config.quantization == "gguf" else set()
        model = model.to_empty(device=self.device).to(mcfg.dtype)
        # Buffers (rotary tables) were on meta: rebuild them for real.
        with torch.device(self.device):
            fresh_rope = type(model.decoder_layers()[0].self_attn.rope)(
                mcfg.head_dim, mcfg.max_model_len + 1, mcfg.rope_theta, mcfg.rope_scaling
            )
        for layer in model.decoder_layers():
            layer.self_attn.rope = fresh_rope
        if parallel is None:
            model.load_weights(source.iter_tensors(mcfg.dtype, skip=consumed))
        else:
            load_shards(model, source, parallel)
        if config.quantization == "int8":
            quantize_int8(model)
        self.model = model.eval()
        self.load_seconds = time.perf_counter() - t0
        self.num_blocks = num_blocks
        # Attend from the paged cache in place with the C kernel where it applies (and
        # run the fused C norms, rotary and silu*mul beside it).
        self.use_cpu_kernel = (
            self.device.type == "cpu"
            and mcfg.dtype == torch.float32
            and config.attention_backend in ("auto", "cpu")
            and cpu_kernels.load() is not None
        )
        if config.attention_backend == "cpu" and not self.use_cpu_kernel:
            raise ValueError(
                "attention_backend='cpu' needs a float32 model on the CPU and a C compiler"
            )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for attn in model.attention_layers():
            shape = (num_blocks, attn.num_kv_heads, self.block_size, attn.head_dim)
            if self.use_cpu_kernel:
                # The kernels' layout (keys d-major within a block), on huge pages where
                # the OS allows: decodes stream the cache every step. Zeroed now, so its
                # pages are faulted in at start-up: left to the first writes, the faults
                # cost as much (1.2 s for the bench's 1.15 GB) inside the first requests.
                k_shape, v_shape = cpu_kernels.kv_cache_shapes(*shape)
                k = cpu_kernels.empty_huge(*k_shape, dtype=mcfg.dtype).zero_()
                v = cpu_kernels.empty_huge(*v_shape, dtype=mcfg.dtype).zero_()
            else:
                k = torch.zeros(shape, dtype=mcfg.dtype, device=self.device)
                v = torch.zeros(shape, dtype=mcfg.dtype, device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.kv_caches.append((k, v))
        self.sampler = Sampler(config.seed)
        if self.use_cpu_kernel and cpu_kernels.gemm_worthwhile() and hasattr(model, "pack_for_cpu"):
            # Weights move into the CPU GEMM kernel's panel layout (layers/linear.py).
            model.pack_for_cpu()
        self.requests: dict[str, RequestState] = {}

    # ------------------------------------------------------------ state diffs
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_ids=new.eos_token_ids,
            )
        for cached in so.scheduled_cached_reqs:
            st = self.requests[cached.req_id]
            st.token_ids.extend(cached.new_token_ids)
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    # ---------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        sched = so.num_scheduled_tokens
        states = [self.requests[r] for r in sched]
        # Decodes first: they are attended together in one padded batch.
        decodes = [s for s in states if sched[s.req_id] == 1 and s.num_computed_tokens > 0]
        # Sorted by length, decodes are padded in small groups of similar lengths: less
        # padding to gather and attend than one group padded to the longest.
        decodes.sort(key=lambda s: s.num_computed_tokens)
        prefills = [s for s in states if not (sched[s.req_id] == 1 and s.num_computed_tokens > 0)]
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        ctx_lens, seq_lens = [], []
        for s in ordered:
            n = sched[s.req_id]
            c = s.num_computed_tokens
            input_ids.extend(s.token_ids[c : c + n])
            positions.extend(range(c, c + n))
            qsl.append(qsl[-1] + n)
            ctx_lens.append(c)
            seq_lens.append(c + n)
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        bs = self.block_size
        nd = len(decodes)
        # Where each new token's K/V goes: (block, offset within it).
        slot_blocks: list[int] = []
        for i, s in enumerate(ordered):
            ids = s.block_ids
            slot_blocks.extend(ids[p // bs] for p in range(ctx_lens[i], seq_lens[i]))
        paged = None
        decode_groups: list[DecodeGroup] = []
        prefill_tables: list[torch.Tensor | None] = []
        if self.use_cpu_kernel:
            # The C kernel attends every sequence from the cache, prefill chunks without
            # context included (their K/V are written before attention runs).
            nblk = -(-max(seq_lens) // bs)
            tables = [s.block_ids[:nblk] for s in ordered]
            paged = PagedSeqs(
                q_starts=torch.tensor(qsl[:-1], dtype=torch.long),
                q_lens=torch.tensor(
                    [qsl[i + 1] - qsl[i] for i in range(len(ordered))], dtype=torch.long
                ),
                seq_lens=torch.tensor(seq_lens, dtype=torch.long),
                block_tables=torch.tensor(
                    [row + [0] * (nblk - len(row)) for row in tables], dtype=torch.long
                ),
            )
        else:
            for start in range(0, nd, DECODE_GROUP_SIZE):
                end = min(start + DECODE_GROUP_SIZE, nd)
                nblk = -(-max(seq_lens[start:end]) // bs)
                # Padding entries point at block 0; the mask hides them.
                rows = [
                    s.block_ids[:nblk] + [0] * (nblk - len(s.block_ids)) for s in decodes[start:end]
                ]
                lens = torch.tensor(seq_lens[start:end], device=dev)
                mask = torch.arange(nblk * bs, device=dev)[None, :] < lens[:, None]
                decode_groups.append(
                    DecodeGroup(
                        start,
                        end,
                        torch.tensor(rows, dtype=torch.long, device=dev),
                        mask[:, None, None, :],
                    )
                )
            for i, s in enumerate(prefills, start=nd):
                has_ctx = ctx_lens[i] > 0
                table = torch.tensor(s.block_ids, dtype=torch.long, device=dev) if has_ctx else None
                prefill_tables.append(table)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=pos_t % bs,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            context_lens=ctx_lens,
            num_decodes=nd,
            block_size=bs,
            paged=paged,
            decode_groups=decode_groups,
            prefill_block_tables=prefill_tables,
            cpu_kernels=self.use_cpu_kernel,
        )
        x = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pp = self.parallel
        if pp is not None and not pp.is_first_stage:
            # A later stage starts from the previous stage's hidden states, not token ids.
            mcfg = self.config.model
            x = pp.recv_prev((len(input_ids), mcfg.hidden_size), mcfg.dtype, dev)
        with set_forward_context(meta):
            hidden = self.model(x, pos_t)
        if pp is not None and not pp.is_last_stage:
            pp.send_next(hidden)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        # Rows to sample: the last token of each request whose step reaches its end.
        sample_rows, sample_states = [], []
        for i, s in enumerate(ordered):
            if seq_lens[i] == len(s.token_ids):
                sample_rows.append(qsl[i + 1] - 1)
                sample_states.append(s)
        sampled: dict[str, list[int]] = {s.req_id: [] for s in ordered}
        lp_by_req: dict[str, list[dict[int, float]]] = {s.req_id: [] for s in ordered}
        want_logprobs = any(s.params.logprobs is not None for s in ordered)
        if sample_rows:
            logits = self.model.compute_logits(hidden[sample_rows])
            sampling_rows = [
                SamplingRow(
                    s.params,
                    s.token_ids[: s.num_prompt_tokens],
                    s.token_ids[s.num_prompt_tokens :],
                    s.eos_token_ids,
                )
                for s in sample_states
            ]
            tokens, lps = self.sampler(logits, sampling_rows)
            for j, s in enumerate(sample_states):
                sampled[s.req_id] = [tokens[j]]
                if lps is not None:
                    lp_by_req[s.req_id] = [lps[j]]
        prompt_lps = self._prompt_logprobs(ordered, qsl, ctx_lens, hidden)
        req_ids = list(sched)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled[r] for r in req_ids],
            logprobs=[lp_by_req[r] for r in req_ids] if want_logprobs else None,
            prompt_logprobs=prompt_lps,
        )

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
