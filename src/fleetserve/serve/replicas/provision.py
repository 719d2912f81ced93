"""LocalProvisioner: serve/replicas/pool_plan.py's `Provisioner` over a model's local replicas (engine
processes on this machine), so that one PoolController keeps every model's pools at their
targets: the initial fill, replacements for replicas that died, hung or got a preemption
notice, and the on-demand fallback while spot is short.

A local machine has no spot market: every pool can always start a replica here. Where a
fleet runs on real spot capacity, the provisioner of that platform (Ray actors on nodes
labelled spot, pods in a spot node pool) raises CapacityUnavailableError when the cloud
refuses; `capacity_check` is where a caller tells this one the same thing (the tests use
it to stand in for a spot market that has none).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fleetserve.serve.config.fleet_config import PoolConfig
from fleetserve.serve.replicas.pool_plan import (
    Capacity,
    CapacityUnavailableError,
    MemberState,
    MemberView,
)
from fleetserve.serve.replicas.replica_set import ReplicaSet

# A fallback replica given back once spot is ready again: its requests may finish for
# this long, then the rest move to the spot replicas.
RELEASE_DRAIN_S = 10.0


class LocalProvisioner:
    def __init__(
        self,
        replica_set: ReplicaSet,
        drain: Callable[[int, float], Awaitable[bool]],
        retiring: set[int],
        start_timeout_s: float = 600.0,
        capacity_check: Callable[[PoolConfig], bool] | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        """`drain(index, timeout_s)` drains and removes a replica (its requests move);
        `retiring` is the service's set of replicas being drained or removed."""
        self.replica_set = replica_set
        self._drain = drain
        self._retiring = retiring
        self.start_timeout_s = start_timeout_s
        self.capacity_check = capacity_check
        self.on_event = on_event or (lambda event: None)
        self._starting: set[int] = set()
        self.last_start_error: str | None = None
        self.started_at: dict[int, float] = {}

    async def start(self, pool: PoolConfig) -> int:
        if self.capacity_check is not None and not self.capacity_check(pool):
            self.on_event("no_capacity")
            raise CapacityUnavailableError(f"pool {pool.name!r} has no {pool.capacity} capacity")
        try:
            replica = self.replica_set.create(pool)
        except Exception as e:
            self.last_start_error = f"pool {pool.name!r}: {e}"
            raise
        self._starting.add(replica.index)
        try:
            await replica.start(self.start_timeout_s)
        except BaseException as e:
            self.last_start_error = f"replica {replica.index}: {e}"
            self.on_event("start_failed")
            self._starting.discard(replica.index)
            await self.replica_set.remove(replica.index)
            raise
        self._starting.discard(replica.index)
        self.started_at[replica.index] = time.monotonic()
        self.last_start_error = None
        self.on_event("started")
        self.replica_set._changed()
        return replica.index

    async def stop(self, index: int) -> None:
        try:
            self.replica_set.get(index)
        except KeyError:
            return  # already gone (it died meanwhile)
        await self._drain(index, RELEASE_DRAIN_S)

    def members(self) -> list[MemberView]:
        out = []
        for r in self.replica_set:
            if r.index in self._starting:
                continue  # the controller counts its own starts
            state: MemberState
            if r.dead_reason is not None:
                state = "dead"
            elif r.index in self._retiring or r.draining:
                state = "draining"
            elif r.healthy:
                state = "ready"
            else:
                state = "starting"
            capacity: Capacity = "spot" if r.capacity == "spot" else "on_demand"
            out.append(MemberView(r.index, r.pool, capacity, state))
        return out
