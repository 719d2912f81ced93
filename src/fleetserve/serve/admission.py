"""What a generate model's admission hands around: a request's prepared prompts while it
waits in its class queue, the refusal the queue gives, and the observer that measures
its latencies by class once it runs (serve/model_service.py uses them)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import EngineOverloadedError
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import RequestOutput
from fleetserve.serve.base import ReplicaStreamLike
from fleetserve.serve.sla import ServiceClass


class ShedError(EngineOverloadedError):
    """Refused by the class queue before any compute: `code` is "overloaded" (the class's
    queue is full) or "queue_timeout" (it waited past max_queue_time_s)."""

    def __init__(self, message: str, class_name: str, code: str) -> None:
        super().__init__(message)
        self.class_name = class_name
        self.code = code

    @classmethod
    def queue_timeout(cls, service_class: ServiceClass) -> ShedError:
        """A request still queued past its class's max_queue_time_s."""
        return cls(
            f"the request waited {service_class.max_queue_time_s:g} s in the "
            f"{service_class.name!r} queue (its max_queue_time_s) without starting; "
            "try again later",
            service_class.name,
            "queue_timeout",
        )


@dataclass
class PreparedPrompt:
    """One prompt of a request, tokenized and validated, with its own engine request id."""

    request_id: str
    prompt: dict[str, Any]  # {"prompt_token_ids": [...], "prompt": text?}
    params: SamplingParams
    num_prompt_tokens: int
    # The output it goes on from (a gateway moved it here from a lost replica).
    resume: RequestOutput | None = None


@dataclass
class Pending:
    """A request in its class queue; `future` gets its streams once it is sent."""

    items: list[PreparedPrompt]
    future: asyncio.Future[list[ReplicaStreamLike]]
    arrival: float  # time.monotonic()
    num_seqs: int = field(init=False)  # the seats it needs on a replica

    def __post_init__(self) -> None:
        self.num_seqs = max(item.params.n for item in self.items)


class ClassObserver:
    """One engine request's latencies by class, from its arrival at the service; keeps the
    service's count of sent-but-unstarted requests per class (`unstarted`) true."""

    def __init__(
        self,
        metrics: ModelMetrics | None,
        class_name: str,
        arrival: float,
        unstarted: Counter[str],
    ) -> None:
        self.metrics, self.class_name, self.arrival = metrics, class_name, arrival
        self.unstarted = unstarted
        self.first: float | None = None
        unstarted[class_name] += 1

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.unstarted[self.class_name] -= 1
        if out.finished and self.metrics is not None:
            num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            ttft = self.first - self.arrival
            self.metrics.observe_latency(self.class_name, ttft, now - self.arrival, num_tokens)

    def on_end(self) -> None:
        if self.first is None:  # ended before its first output (aborted, failed)
            self.first = time.monotonic()
            self.unstarted[self.class_name] -= 1
