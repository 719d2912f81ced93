"""SLA classes and the per-model class queue (pure Python: no asyncio, no engine).

A model's requests wait here until a replica has room for them. Order: the class's
priority (lower first), then the request's own priority (lower first, vLLM's meaning),
then its deadline (arrival + the class's `max_queue_time_s`), then arrival. Each class
has its own bound (`max_waiting`: a push past it raises `QueueFullError`) and, with
`max_queue_time_s`, a deadline: `expire(now)` takes out every entry still queued past
it, so the caller can refuse them before they cost any compute.

The engine sees the same order through one integer (`engine_priority`): the scheduler's
"priority" policy runs lower values first and preempts higher ones when it runs short.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

# A request's own priority is a signed 32-bit int (the API's range); a class's priority
# sits above it, so every request of a more important class comes first.
REQUEST_PRIORITY_SPAN = 2**32


@dataclass(frozen=True)
class ServiceClass:
    name: str
    priority: int = 0
    max_waiting: int = 256
    max_queue_time_s: float | None = None
    # No first token this long after it was sent: a copy goes to another replica and the
    # first to answer wins (serve/resilience/migration.py). None: no hedging.
    hedge_after_s: float | None = None
    # Batches' worth of sequences a replica takes at this class's level (>= 1): above 1
    # the surplus waits in the engine's queue, ready for the next free slot.
    oversubscribe: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a class needs a name")
        if self.hedge_after_s is not None and not self.hedge_after_s > 0:
            raise ValueError(f"classes.{self.name}.hedge_after_s must be > 0")
        if not self.oversubscribe >= 1.0:
            raise ValueError(f"classes.{self.name}.oversubscribe must be >= 1")
        if self.max_waiting < 0:
            raise ValueError(f"classes.{self.name}.max_waiting must be >= 0")
        if self.max_queue_time_s is not None and not self.max_queue_time_s > 0:
            raise ValueError(f"classes.{self.name}.max_queue_time_s must be > 0")


def oversubscription(classes: Mapping[str, ServiceClass]) -> dict[int, float]:
    """Class level -> the factor of a batch a replica takes at that level, for the levels
    above one batch (classes that share a level share its seats: the larger factor)."""
    out: dict[int, float] = {}
    for c in classes.values():
        if c.oversubscribe > 1.0:
            out[c.priority] = max(out.get(c.priority, 1.0), c.oversubscribe)
    return out


def engine_priority(service_class: ServiceClass, request_priority: int) -> int:
    """One number for the engine's scheduler: class first, then the request's own."""
    return service_class.priority * REQUEST_PRIORITY_SPAN + request_priority


def split_engine_priority(priority: int) -> tuple[int, int]:
    """engine_priority's inverse: (class priority, request priority), the request's own
    being a signed 32-bit int."""
    level = (priority + REQUEST_PRIORITY_SPAN // 2) // REQUEST_PRIORITY_SPAN
    return level, priority - level * REQUEST_PRIORITY_SPAN


class QueueFullError(RuntimeError):
    """The class's queue holds `max_waiting` requests already."""

    def __init__(self, service_class: ServiceClass) -> None:
        super().__init__(
            f"the {service_class.name!r} queue is full ({service_class.max_waiting} requests "
            "waiting); try again later"
        )
        self.service_class = service_class


@dataclass(eq=False)
class Entry(Generic[T]):
    """One queued request; `payload` is whatever the caller needs to submit it later."""

    payload: T
    service_class: ServiceClass
    priority: int
    arrival: float
    deadline: float  # math.inf without max_queue_time_s
    seq: int
    queued: bool = field(default=True)

    @property
    def key(self) -> tuple[int, int, float, int]:
        return (self.service_class.priority, self.priority, self.deadline, self.seq)

    def __lt__(self, other: Entry[T]) -> bool:
        return self.key < other.key


class ClassQueue(Generic[T]):
    """The waiting requests of one model, across its classes. Owned by one ModelService;
    every method is called on its event loop thread."""

    def __init__(self, classes: Mapping[str, ServiceClass], default_class: str) -> None:
        if not classes:
            raise ValueError("at least one class is needed")
        if default_class not in classes:
            raise ValueError(
                f"default_class {default_class!r} is not one of the classes "
                f"({', '.join(sorted(classes))})"
            )
        self.classes = dict(classes)
        self.default_class = default_class
        self._heap: list[Entry[T]] = []  # holds removed entries too, until they surface
        # Per class, in arrival order: the deadlines expire in this order.
        self._by_arrival: dict[str, deque[Entry[T]]] = {name: deque() for name in classes}
        self._num_waiting: dict[str, int] = dict.fromkeys(classes, 0)
        self._seq = itertools.count()

    def resolve(self, name: str | None) -> ServiceClass:
        """The class called `name` (None: the default); ValueError naming the known ones."""
        if name is None:
            return self.classes[self.default_class]
        cls = self.classes.get(name)
        if cls is None:
            raise ValueError(
                f"service_tier {name!r} is not a service class here (header X-Fleetserve-Class "
                f"or body service_tier); classes: {', '.join(sorted(self.classes))}"
            )
        return cls

    def __len__(self) -> int:
        return sum(self._num_waiting.values())

    def num_waiting(self, class_name: str) -> int:
        return self._num_waiting[class_name]

    def push(self, payload: T, class_name: str, priority: int, now: float) -> Entry[T]:
        cls = self.resolve(class_name)
        if self._num_waiting[cls.name] >= cls.max_waiting:
            raise QueueFullError(cls)
        wait = cls.max_queue_time_s
        deadline = now + wait if wait is not None else math.inf
        entry = Entry(payload, cls, priority, now, deadline, next(self._seq))
        heapq.heappush(self._heap, entry)
        self._by_arrival[cls.name].append(entry)
        self._num_waiting[cls.name] += 1
        return entry

    def peek(self) -> Entry[T] | None:
        """The next entry `pop` would return, without taking it out."""
        while self._heap and not self._heap[0].queued:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def pop(self) -> Entry[T] | None:
        entry = self.peek()
        if entry is not None:
            heapq.heappop(self._heap)
            self._take_out(entry)
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        """Takes out a queued entry (its client left); False if it was no longer queued."""
        if not entry.queued:
            return False
        self._take_out(entry)
        return True

    def expire(self, now: float) -> list[Entry[T]]:
        """Takes out and returns every entry whose deadline is past, oldest first per class."""
        expired: list[Entry[T]] = []
        for q in self._by_arrival.values():
            while q and (not q[0].queued or q[0].deadline <= now):
                entry = q.popleft()
                if entry.queued:
                    self._take_out(entry)
                    expired.append(entry)
        return expired

    def take_arrived_by(self, cutoff: float) -> list[Entry[T]]:
        """Takes out and returns every entry that arrived at or before `cutoff`, oldest first
        per class (a model with no replica bounds how long its requests wait for one)."""
        taken: list[Entry[T]] = []
        for q in self._by_arrival.values():
            while q and (not q[0].queued or q[0].arrival <= cutoff):
                entry = q.popleft()
                if entry.queued:
                    self._take_out(entry)
                    taken.append(entry)
        return taken

    def next_deadline(self) -> float:
        """The earliest deadline of a queued entry (math.inf if none)."""
        best = math.inf
        for q in self._by_arrival.values():
            while q and not q[0].queued:
                q.popleft()
            if q:
                best = min(best, q[0].deadline)
        return best

    def __iter__(self) -> Iterator[Entry[T]]:
        """The queued entries in pop order (for tests and debugging; O(n log n))."""
        return iter(sorted(e for e in self._heap if e.queued))

    def _take_out(self, entry: Entry[T]) -> None:
        entry.queued = False
        self._num_waiting[entry.service_class.name] -= 1
