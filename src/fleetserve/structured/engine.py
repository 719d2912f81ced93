"""The engine core's structured-outputs state: the grammar backend and the step masks,
both made on the first constrained request (an engine that never sees one pays nothing:
no tokenizer load, no thread)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fleetserve.config import EngineConfig
from fleetserve.core.request import Request
from fleetserve.core.scheduler import Scheduler
from fleetserve.core.scheduler_output import SchedulerOutput
from fleetserve.core.structured import GrammarBitmask, GrammarMatcher
from fleetserve.models.loader import ModelSource

if TYPE_CHECKING:
    from fleetserve.structured.backend import GrammarBackend
    from fleetserve.structured.step_masks import StepMasks


def mask_overlap_enabled() -> bool:
    """FLEETSERVE_MASK_OVERLAP=0 fills masks inline (before the forward pass), for A/B."""
    return os.environ.get("FLEETSERVE_MASK_OVERLAP", "1") != "0"


class StructuredOutputs:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self._config = config
        self._source = source
        self._backend: GrammarBackend | None = None
        self._masks: StepMasks | None = None

    def _ensure(self) -> None:
        if self._backend is not None:
            return
        from fleetserve.structured.backend import GrammarBackend
        from fleetserve.structured.step_masks import StepMasks
        from fleetserve.tokenizer import Tokenizer

        tok = Tokenizer.from_source(self._source)
        eos = set(self._config.model.eos_token_ids) | tok.stop_token_ids
        backend = GrammarBackend(tok.transformers(), self._config.model.vocab_size, sorted(eos))
        self._masks = StepMasks(backend.mask_vocab_size, mask_overlap_enabled())
        self._backend = backend

    def matcher_for(self, request: Request) -> GrammarMatcher:
        self._ensure()
        assert self._backend is not None
        return self._backend.matcher_for(request)

    def start_masks(
        self, sched_out: SchedulerOutput, scheduler: Scheduler
    ) -> GrammarBitmask | None:
        if self._masks is None:
            return None
        return self._masks.start(sched_out, scheduler.requests)

    def stats(self) -> dict[str, float]:
        return self._masks.stats() if self._masks is not None else {}

    def shutdown(self) -> None:
        if self._masks is not None:
            self._masks.shutdown()
