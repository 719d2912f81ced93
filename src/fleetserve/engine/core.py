"""EngineCore: the step loop of one replica (scheduler + executor)."""

from __future__ import annotations

import time
from collections import deque

from fleetserve.config import EngineConfig, sliding_window_of
from fleetserve.core.block_manager import BlockManager
from fleetserve.core.hybrid_blocks import HybridBlockManager
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.request import Request, RequestStatus
from fleetserve.core.scheduler import Scheduler
from fleetserve.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from fleetserve.engine.stats import EngineStats, SpecDecodeStats
from fleetserve.executor.base import Executor, ModelOutputFuture
from fleetserve.lora.cache import AdapterCache
from fleetserve.models.loader import ModelSource
from fleetserve.structured.engine import StructuredOutputs


def spec_decode_stats(sched: Scheduler) -> SpecDecodeStats:
    """Totals since start, and the two ratios: accepted / proposed draft tokens, and
    tokens emitted per verification (accepted drafts + the target's own token)."""
    return SpecDecodeStats.of(
        sched.num_spec_verifications, sched.num_draft_tokens, sched.num_accepted_tokens
    )


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    if config.parallel.world_size > 1:
        from fleetserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, source)
    from fleetserve.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config, source)


def make_block_manager(config: EngineConfig, num_blocks: int) -> BlockManager:
    """One pool for every layer, its blocks released past the window when every layer
    has one (Mistral); for local and global layers (Gemma 3) a second pool for the local
    ones (core/hybrid_blocks.py)."""
    cache, mcfg = config.cache, config.model
    window = sliding_window_of(mcfg)
    num_sliding = cache.resolve_sliding_blocks(mcfg, config.scheduler, num_blocks)
    if window is not None and num_sliding:
        return HybridBlockManager(
            num_blocks,
            num_sliding,
            cache.block_size,
            window if cache.free_window_blocks else None,
            cache.enable_prefix_caching,
        )
    all_windowed = window is not None and cache.free_window_blocks
    return BlockManager(
        num_blocks,
        cache.block_size,
        cache.enable_prefix_caching,
        window if all_windowed else None,
    )


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.executor = make_executor(config, source)
        self.block_manager = make_block_manager(config, self.executor.num_blocks)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        # Grammar matchers and step masks, built on the first constrained request.
        self.structured = StructuredOutputs(config, source)
        self.last_step_seconds = 0.0
        self.num_steps = 0
        self.step_seconds = 0.0  # in steps that ran, since start
        self.num_step_tokens = 0
        # Pipeline parallelism: submitted steps not yet taken back, oldest first.
        self._in_flight: deque[tuple[SchedulerOutput, ModelOutputFuture]] = deque()
        self._in_flight_req_ids: set[str] = set()
        # LoRA: adapters loaded off the loop; requests wait there for theirs.
        self.lora: AdapterCache | None = None
        self._lora_rejected: list[tuple[str, str]] = []
        if config.lora is not None:
            self.lora = AdapterCache(
                config.lora, config.model, self.executor.add_lora, self.executor.remove_lora
            )
            for i, (name, path) in enumerate(config.lora.modules[: config.lora.cpu_capacity]):
                self.lora.preload(LoRARequest(name, i + 1, path))

    def add_request(self, request: Request) -> None:
        vocab = self.config.model.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if request.sampling_params.structured_outputs is not None:
            request.grammar = self.structured.matcher_for(request)
        lora = request.lora_request
        if lora is not None:
            if self.lora is None:
                raise ValueError(
                    f"LoRA adapter {lora.lora_name!r} requested, but this engine was started "
                    "without enable_lora"
                )
            if not self.lora.is_ready(lora):
                self.scheduler.check_request(request)
                self.lora.park(request)
                return
        self.scheduler.add_request(request)

    def load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter now, in this thread (the offline engine: a bad adapter is
        the caller's ValueError at once)."""
        if self.lora is None:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} requested, but this engine was started "
                "without enable_lora"
            )
        if not self.lora.is_ready(lora):
            self.lora.preload(lora, frozenset(self._loras_in_use()))

    def _loras_in_use(self) -> set[str]:
        return {r.lora_name for r in self.scheduler.requests.values() if r.lora_name}

    def take_rejected(self) -> list[tuple[str, str]]:
        """Requests refused after they were accepted (their adapter failed to load)."""
        out, self._lora_rejected = self._lora_rejected, []
        return out

    def abort_requests(self, req_ids: list[str]) -> None:
        if self.lora is not None:
            self.lora.unpark(set(req_ids))
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, req_ids: list[str]) -> None:
        """Finish requests that hit a stop string (found by the detokenizing side)."""
        if self.lora is not None:
            self.lora.unpark(set(req_ids))
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        parked = self.lora is not None and self.lora.num_parked() > 0
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight) or parked

    def _admit_loaded(self) -> None:
        """Requests whose adapter finished loading join the scheduler (between steps)."""
        assert self.lora is not None
        if not self.scheduler.has_unfinished_requests() and self.lora.num_parked():
            self.lora.wait(0.005)  # nothing else to run: sleep until a load is done
        ready, failed = self.lora.poll(self._loras_in_use())
        for req in ready:
            try:
                self.scheduler.add_request(req)
            except ValueError as e:
                self._lora_rejected.append((req.req_id, str(e)))
        self._lora_rejected.extend((req.req_id, msg) for req, msg in failed)

    def step(self) -> list[EngineCoreOutput]:
        if self.lora is not None:
            self._admit_loaded()
        if self.executor.max_concurrent_batches > 1:
            return self._step_pipelined()
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.finished_req_ids:
            return []
        sched_out.grammar_bitmask = self.structured.start_masks(sched_out, self.scheduler)
        result = self.executor.execute_model(sched_out)
        outputs = self.scheduler.update_from_output(sched_out, result)
        self._count_step(time.perf_counter() - t0, sched_out)
        return outputs

    def _count_step(self, seconds: float, sched_out: SchedulerOutput) -> None:
        self.last_step_seconds = seconds
        self.num_steps += 1
        self.step_seconds += seconds
        self.num_step_tokens += sched_out.total_num_scheduled_tokens

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Submit a new batch while fewer than `max_concurrent_batches` are in flight and
        return at once, so that the next call can fill the next pipeline stage; otherwise
        take back the oldest batch. A request rides in at most one in-flight batch, and
        each batch holds at most 1/PP of the requests so that decodes spread over stages."""
        t0 = time.perf_counter()
        depth = self.executor.max_concurrent_batches
        if len(self._in_flight) < depth:
            sched = self.scheduler
            cap = -(-(sched.num_running + sched.num_waiting) // depth)
            sched_out = sched.schedule(self._in_flight_req_ids, max(1, cap))
            if not sched_out.is_empty or sched_out.finished_req_ids:
                sched_out.grammar_bitmask = self.structured.start_masks(sched_out, sched)
                future = self.executor.execute_model_async(sched_out)
                self._in_flight.append((sched_out, future))
                self._in_flight_req_ids.update(sched_out.num_scheduled_tokens)
                if not sched_out.is_empty and len(self._in_flight) < depth:
                    return []
        if not self._in_flight:
            return []
        sched_out, future = self._in_flight.popleft()
        result = future.result()
        self._in_flight_req_ids.difference_update(sched_out.num_scheduled_tokens)
        outputs = self.scheduler.update_from_output(sched_out, result)
        self._count_step(time.perf_counter() - t0, sched_out)
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        masks = self.structured.stats()
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            kv_cache_usage_perc=bm.usage,
            prefix_cache_hit_rate=bm.hit_rate,
            prefix_cache_queries=bm.num_queried_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            last_step_seconds=self.last_step_seconds,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            num_step_tokens=self.num_step_tokens,
            spec_decode=(
                spec_decode_stats(self.scheduler) if self.config.speculative is not None else None
            ),
            structured_mask_steps=int(masks.get("structured_mask_steps", 0)),
            structured_mask_rows=int(masks.get("structured_mask_rows", 0)),
            structured_mask_seconds=masks.get("structured_mask_seconds", 0.0),
        )

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.lora is not None:
            self.lora.shutdown()
        self.executor.shutdown()
