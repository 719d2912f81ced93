"""Executor interface: runs the workers of one replica."""

from __future__ import annotations

import abc
from typing import Any

from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ModelOutputFuture(abc.ABC):
    """The result of a step submitted with `execute_model_async`."""

    @abc.abstractmethod
    def result(self) -> ModelRunnerOutput:
        """Block until the step's output is back (raises if a worker failed)."""


class DoneOutput(ModelOutputFuture):
    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output


class Executor(abc.ABC):
    """Owns the model workers of one engine replica.

    ``execute_model`` and ``execute_model_async`` are called by the engine core's step loop
    only, from one thread. Up to ``max_concurrent_batches`` steps may be submitted with
    ``execute_model_async`` before the oldest one's result is taken; results come back in
    submission order, and a request is in at most one unfinished step.
    ``shutdown`` may be called from any thread and more than once.
    """

    num_blocks: int

    @property
    def max_concurrent_batches(self) -> int:
        return 1

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelOutputFuture:
        return DoneOutput(self.execute_model(scheduler_output))

    def add_lora(self, adapter: Any) -> None:
        """Give every worker a loaded LoRA adapter (lora/adapter.py: LoRAAdapter); steps
        submitted after this call may use it."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def remove_lora(self, name: str) -> None:
        """Workers drop the adapter (no step submitted after this call uses it)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    @abc.abstractmethod
    def shutdown(self) -> None: ...
