"""How long a request waits for a replica when its model has none.

A model may have no routable replica for a while and still take requests: its replicas
are being replaced (they died, were drained), or it is a gateway's remote model whose pods
are at zero (Kubernetes scales them from zero once the gateway's queue depth says that
requests wait: deploy/keda.py). Such requests wait in their class queue, as they do for
room on a busy replica, and are sent when a replica comes up. Their class's
`max_queue_time_s` bounds the wait as always; `NoReplicaWait` adds the model's
`resilience.migration_wait_s`, the same bound a moving request has: once the model has had
no replica for that long, the requests that have waited that long are shed (503 with
Retry-After, code `no_replica`), so that a model whose replicas never come back does not
hold its clients forever. Requests that arrive later wait their own full bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fleetserve.serve.admission.admit import ShedError
from fleetserve.serve.admission.sla import ClassQueue

SHED_REASON = "no_replica"


class NoReplicaWait:
    """Owned by one model's service; `step()` runs on its event loop every `interval_s`.

    `has_replica()`: some replica is routable now. `shed(class_name, reason)` counts a
    shed request (the service's metric)."""

    def __init__(
        self,
        model: str,
        queue: ClassQueue[Any],
        has_replica: Callable[[], bool],
        shed: Callable[[str, str], None],
        wait_s: float,
        interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if wait_s < 0 or interval_s <= 0:
            raise ValueError(f"need wait_s >= 0 and interval_s > 0; got {wait_s}, {interval_s}")
        self.model = model
        self.queue = queue
        self.has_replica = has_replica
        self.shed = shed
        self.wait_s = wait_s
        self.interval_s = interval_s
        self.clock = clock
        self.since: float | None = None  # when the model was last seen without a replica

    def step(self) -> int:
        """Sheds what waited too long for a replica; returns how many were shed."""
        now = self.clock()
        if self.has_replica():
            self.since = None
            return 0
        if self.since is None:
            self.since = now
        if now - self.since < self.wait_s:
            return 0
        # An entry that arrived by the cutoff has waited wait_s, and wait_s of that without
        # a replica (the model has had none since `since`, itself before the cutoff).
        expired = self.queue.take_arrived_by(now - self.wait_s)
        for entry in expired:
            cls = entry.service_class
            self.shed(cls.name, SHED_REASON)
            future = entry.payload.future
            if not future.done():
                future.set_exception(
                    ShedError(
                        f"no replica of {self.model!r} came up within {self.wait_s:g} s "
                        "(migration_wait_s) while the request waited; try again later",
                        cls.name,
                        SHED_REASON,
                    )
                )
        return len(expired)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.step()
