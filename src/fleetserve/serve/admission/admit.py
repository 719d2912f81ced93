"""A generate model's admission, written once for the local service
(serve/services/generate.py) and the Ray ingress (ray/clients.py): `Admission` holds the
class queue with its refusals (ShedError when a class is full or a request waits past
its max_queue_time_s, each counted in the shed metric); beside it, a request's prepared
prompts while it waits, and the observer that measures its latencies by class once it
runs. What a service does when a request's turn comes (its dispatch) stays its own."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import EngineOverloadedError
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import RequestOutput

if TYPE_CHECKING:
    from fleetserve.serve.request_state import FleetStream, RequestState
from fleetserve.serve.admission.sla import ClassQueue, Entry, QueueFullError, ServiceClass


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
    # The whole output it goes on from (a gateway moved it here from a lost replica).
    resume: RequestOutput | None = None
    # The LoRA adapter it runs with (None: the base model); kept when it moves.
    lora: LoRARequest | None = None


@dataclass
class Pending:
    """A request in its class queue; `future` gets its streams once it is sent."""

    items: list[PreparedPrompt]
    future: asyncio.Future[list[FleetStream]]
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

    def on_output(self, delta: RequestOutput, state: RequestState) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.unstarted[self.class_name] -= 1
        if delta.finished and self.metrics is not None:
            num_tokens = state.fold.max_choice_tokens()
            ttft = self.first - self.arrival
            self.metrics.observe_latency(self.class_name, ttft, now - self.arrival, num_tokens)

    def on_end(self) -> None:
        if self.first is None:  # ended before its first output (aborted, failed)
            self.first = time.monotonic()
            self.unstarted[self.class_name] -= 1


class Waiter(Protocol):
    """A queued request as admission sees it: `future` is failed when it is refused."""

    @property
    def future(self) -> asyncio.Future[Any]: ...

    @property
    def arrival(self) -> float: ...  # time.monotonic()


W = TypeVar("W", bound=Waiter)


class Admission(Generic[W]):
    """One model's class queue and its refusals. Owned by one service; every method runs
    on that service's event loop thread. The service pops what it sends (`queue`)."""

    def __init__(
        self,
        model_name: str,
        classes: Mapping[str, ServiceClass],
        default_class: str,
        metrics: ModelMetrics | None,
        *,
        priority_ordered: bool,
    ) -> None:
        self.model_name = model_name
        self.queue: ClassQueue[W] = ClassQueue(classes, default_class)
        self.metrics = metrics
        # A request's own `priority` reaches the engine only under the priority policy;
        # elsewhere a non-zero one is refused rather than ignored.
        self.priority_ordered = priority_ordered
        self._expiry: asyncio.TimerHandle | None = None

    def resolve(self, class_name: str | None, priority: int) -> ServiceClass:
        """The request's class; ValueError for an unknown class, or for a priority the
        model's engines would ignore."""
        cls = self.queue.resolve(class_name)
        if priority != 0 and not self.priority_ordered:
            raise ValueError(
                f"priority is not honoured by {self.model_name!r}: it schedules first-come "
                "first-served; serve it with scheduling_policy priority to order by priority"
            )
        return cls

    def push(self, waiter: W, service_class: ServiceClass, priority: int) -> Entry[W]:
        """Queues the request, or sheds it (ShedError "overloaded") when its class is full."""
        try:
            entry = self.queue.push(waiter, service_class.name, priority, waiter.arrival)
        except QueueFullError as e:
            self.shed(service_class.name, "queue_full")
            raise ShedError(str(e), service_class.name, "overloaded") from None
        self._schedule_expiry()
        return entry

    def fail_all(self, error: Callable[[], Exception]) -> None:
        """Takes every request out of the queue, failing each with a new `error()`."""
        while (entry := self.queue.pop()) is not None:
            if not entry.payload.future.done():
                entry.payload.future.set_exception(error())

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _schedule_expiry(self) -> None:
        """One timer, at the earliest deadline of a queued request."""
        deadline = self.queue.next_deadline()
        if deadline == float("inf"):
            return
        if self._expiry is not None and self._expiry.when() <= deadline:
            return
        if self._expiry is not None:
            self._expiry.cancel()
        # loop.time() is time.monotonic() on every asyncio loop of CPython.
        self._expiry = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        for entry in self.queue.expire(time.monotonic()):
            cls = entry.service_class
            self.shed(cls.name, "queue_timeout")
            if not entry.payload.future.done():
                entry.payload.future.set_exception(ShedError.queue_timeout(cls))
        self._schedule_expiry()

    def shed(self, class_name: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.add_shed(class_name, reason)
