"""The supervisor of one model's replicas: notices the dead and the hung, drains the
ones given a preemption notice (or drained by hand), and keeps the admin view.

Every `SUPERVISE_INTERVAL_S` it looks at each replica. A dead one (its engine process
exited; its AsyncEngine has already ended its streams with ReplicaGoneError, so their
requests are moving) is removed. One that holds work and has run no engine step for
`hang_timeout_s` is hung: its requests are handed over, its process is killed and it is
removed. The pool controller (serve/replicas/pool_plan.py) then starts replacements. A replica whose
engine sends a notice (SIGTERM, a cloud's spot notice) is drained: it takes nothing new,
its short requests finish, the rest move before the notice's deadline, then it is stopped.

Runs on the API process's event loop thread, like its service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fleetserve.engine.wire import CoreNotice
from fleetserve.metrics import ModelMetrics
from fleetserve.serve.config.fleet_config import ResilienceConfig
from fleetserve.serve.contracts import Replica
from fleetserve.serve.replicas.replica_set import ReplicaSet

# How often the replicas are looked at (a dead one is seen by its engine's process watch
# within 0.2 s; this bounds how soon it is removed and replaced, and a hang is seen).
SUPERVISE_INTERVAL_S = 0.25
# A replica given a notice lets its requests run until this long before the deadline;
# then the rest move and it is stopped.
NOTICE_MARGIN_S = 3.0

log = logging.getLogger("fleetserve.serve")


def notice_window_s(notice: CoreNotice, now: float) -> float:
    """How long a replica given `notice` lets its requests run before the rest move
    (`now`: time.time(), the clock of the notice's deadline)."""
    return max(0.0, notice.deadline - now - NOTICE_MARGIN_S)


def is_hung(replica: Replica, now: float, hang_timeout_s: float | None) -> bool:
    """Whether the replica has held work without an engine step for longer than
    `hang_timeout_s` (None: hangs are not looked for). `now`: time.monotonic()."""
    return hang_timeout_s is not None and replica.hung_for(now) > hang_timeout_s


class Supervisor:
    def __init__(
        self,
        name: str,
        replica_set: ReplicaSet,
        resilience: ResilienceConfig,
        metrics: ModelMetrics | None,
        on_change: Callable[[], None],
    ) -> None:
        """`on_change` is called when a replica starts or stops being routable."""
        self.name = name
        self.replica_set = replica_set
        self.resilience = resilience
        self.metrics = metrics
        self.on_change = on_change
        self.retiring: set[int] = set()  # replicas being drained or removed
        self.num_failed = 0  # replicas that died
        self.closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run())

    def stop(self) -> None:
        self.closing = True
        for task in [self._loop_task, *self._tasks]:
            if task is not None:
                task.cancel()

    def event(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.add_replica_event(event)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------- drain
    def on_notice(self, replica: Replica, notice: CoreNotice) -> None:
        """Its engine will be taken away by `notice.deadline`: drain it now (short
        requests finish, the rest move before the deadline); a replacement starts."""
        if replica.index in self.retiring or self.closing:
            return  # already on its way out
        log.warning("%s: replica %d got a preemption notice (%s, %s); draining it",
                    self.name, replica.index, notice.source, notice.detail)  # fmt: skip
        self.event("notice")
        self.start_drain(replica.index, notice_window_s(notice, time.time()))

    def start_drain(self, index: int, timeout_s: float) -> bool:
        """drain_replica in the background; False if it is already being drained."""
        self.replica_set.get(index)  # KeyError: no such replica
        if index in self.retiring or self.closing:
            return False
        self.retiring.add(index)
        self.spawn(self.drain_replica(index, timeout_s))
        return True

    async def drain_replica(self, index: int, timeout_s: float) -> bool:
        """Routes nothing more to the replica, lets its short requests finish within
        `timeout_s`, moves the rest to other replicas, then stops and removes it (the
        pool controller starts a replacement). True if none of its requests moved."""
        replica = self.replica_set.get(index)  # KeyError: no such replica
        self.retiring.add(index)
        try:
            self.on_change()
            clean = await replica.drain(timeout_s)
            await self.replica_set.remove(index)
            self.event("drained")
            return clean
        finally:
            self.retiring.discard(index)
            self.on_change()

    # ------------------------------------------------------------- dead and hung
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            try:
                self.check(time.monotonic())
            except Exception:  # the supervisor must outlive any one bad check
                log.exception("%s: replica supervision failed", self.name)

    def check(self, now: float) -> None:
        hang_s = self.resilience.hang_timeout_s
        for r in list(self.replica_set):
            if r.index in self.retiring:
                continue
            if r.dead_reason is not None:
                log.error("%s: replica %d died: %s", self.name, r.index, r.dead_reason)
                self.event("failed")
                self.num_failed += 1
                self.retiring.add(r.index)
                self.spawn(self._remove(r.index, kill=False))
            elif is_hung(r, now, hang_s):
                log.error("%s: replica %d ran no step for %.1f s while holding work; "
                          "killing it", self.name, r.index, r.hung_for(now))  # fmt: skip
                self.event("hung")
                self.retiring.add(r.index)
                r.evict_all("the replica hung")
                self.spawn(self._remove(r.index, kill=True))

    async def _remove(self, index: int, kill: bool) -> None:
        try:
            replica = self.replica_set.get(index)
            if kill:
                await replica.stop(kill=True)
            await self.replica_set.remove(index)
        finally:
            self.retiring.discard(index)
            self.on_change()

    # ------------------------------------------------------------- admin view
    def replica_views(self) -> list[dict[str, Any]]:
        """The replicas as the admin API shows them."""
        out = []
        for r in self.replica_set:
            state = (
                "dead" if r.dead_reason is not None
                else "draining" if r.index in self.retiring or r.draining
                else "ready" if r.healthy
                else "starting"
            )  # fmt: skip
            out.append(
                {
                    "id": f"{self.name}:{r.index}",
                    "index": r.index,
                    "pool": r.pool,
                    "capacity": r.capacity,
                    "state": state,
                    "pid": r.pid,
                    "url": getattr(r, "url", None),  # a remote replica's pod
                    "num_requests": r.num_outstanding_requests,
                }
            )
        return out
