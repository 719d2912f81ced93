"""EngineCore: the step loop of one replica (scheduler + executor)."""

from __future__ import annotations

import time

from fleetserve.config import EngineConfig
from fleetserve.core.block_manager import BlockManager
from fleetserve.core.request import Request, RequestStatus
from fleetserve.core.scheduler import Scheduler
from fleetserve.core.scheduler_output import EngineCoreOutput
from fleetserve.executor.base import Executor
from fleetserve.models.loader import ModelSource


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    if config.parallel.world_size > 1:
        from fleetserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, source)
    from fleetserve.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config, source)


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.executor = make_executor(config, source)
        self.block_manager = BlockManager(
            self.executor.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.last_step_seconds = 0.0
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        vocab = self.config.model.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, req_ids: list[str]) -> None:
        """Finish requests that hit a stop string (found by the detokenizing side)."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.finished_req_ids:
            return []
        result = self.executor.execute_model(sched_out)
        outputs = self.scheduler.update_from_output(sched_out, result)
        self.last_step_seconds = time.perf_counter() - t0
        self.num_steps += 1
        return outputs

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": bm.usage,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_queries": bm.num_queried_tokens,
            "prefix_cache_hits": bm.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "last_step_seconds": self.last_step_seconds,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
