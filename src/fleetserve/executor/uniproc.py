"""Everything in the caller's process: one worker, no communication."""

from __future__ import annotations

from typing import Any

import torch

from fleetserve.config import EngineConfig
from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fleetserve.executor.base import Executor
from fleetserve.models.loader import ModelSource
from fleetserve.worker.model_runner import ModelRunner


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.num_blocks = config.cache.resolve_num_blocks(
            config.model, config.scheduler.max_num_seqs, config.kv_dtype
        )
        self.runner = ModelRunner(config, source, self.num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def add_lora(self, adapter: Any) -> None:
        assert self.runner.lora is not None, "LoRA is off in this engine"
        self.runner.lora.add(adapter)

    def remove_lora(self, name: str) -> None:
        assert self.runner.lora is not None, "LoRA is off in this engine"
        self.runner.lora.remove(name)

    def shutdown(self) -> None:
        pass
