"""Executor interface: runs the workers of one replica."""

from __future__ import annotations

import abc

from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    """Owns the model workers of one engine replica.

    ``execute_model`` is called by the engine core's step loop only, one call at a time.
    ``shutdown`` may be called from any thread and more than once.
    """

    num_blocks: int

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...
