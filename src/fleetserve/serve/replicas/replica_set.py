"""ReplicaSet: the replicas of one model, added, drained and removed while it serves.

The set owns the member list; the model's Router reads that same list (index order), so
a replica added here is routable as soon as it is healthy, and one being drained stops
getting requests at once (`healthy` turns false) while it finishes what it holds. An
autoscaler, a spot-preemption notice or a failure handler calls these methods; so do the
tests. Indices are never reused, so metrics and logs keep telling replicas apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from fleetserve.serve.config.fleet_config import PoolConfig
from fleetserve.serve.contracts import Replica


class ReplicaSet:
    """`factory(index, pool)` makes a replica of a pool (serve/replicas/pool_plan.py's PoolConfig; None:
    the model's default pool)."""

    def __init__(self, factory: Callable[[int, PoolConfig | None], Replica]) -> None:
        self._factory = factory
        self.members: list[Replica] = []
        self._next_index = 0
        # Called after the membership or a member's room changes (the service dispatches).
        self.on_change: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.members if r.healthy]

    def get(self, index: int) -> Replica:
        for r in self.members:
            if r.index == index:
                return r
        raise KeyError(f"no replica {index}; replicas: {[r.index for r in self.members]}")

    def create(self, pool: PoolConfig | None = None) -> Replica:
        """A new member, not started (it is not healthy, so nothing is routed to it yet)."""
        replica = self._factory(self._next_index, pool)
        self._next_index += 1
        replica.on_finish = self._changed
        self.members.append(replica)
        return replica

    async def add(self, timeout_s: float = 600.0, pool: PoolConfig | None = None) -> Replica:
        """Starts one more replica while the others serve; it takes requests once loaded.
        If it fails to start it is removed again and the error is raised."""
        replica = self.create(pool)
        try:
            await replica.start(timeout_s)
        except BaseException:
            await self.remove(replica.index)
            raise
        self._changed()
        return replica

    async def drain(self, index: int, timeout_s: float = 30.0, migrate: bool = True) -> bool:
        """Routes nothing more to the replica, lets it finish what it holds (up to
        `timeout_s`; the rest moves to other replicas, or with migrate=False is aborted),
        then stops and removes it. True if nothing had to move or be aborted."""
        replica = self.get(index)
        clean = await replica.drain(timeout_s, migrate)
        await self.remove(index)
        return clean

    async def remove(self, index: int) -> None:
        """Stops the replica now (its open requests move to other replicas:
        ReplicaGoneError) and forgets it."""
        replica = self.get(index)
        self.members.remove(replica)
        try:
            await replica.stop()
        finally:
            self._changed()

    async def stop_all(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.members))

    def _changed(self, replica: Replica | None = None) -> None:
        if self.on_change is not None:
            self.on_change()
