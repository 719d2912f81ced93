"""Spot and on-demand pools of one model: which replicas to start and stop (`plan`), the
loop that does it through a `Provisioner` (`PoolController`), and spot-first routing.

The policy follows SpotHedge (SkyServe, Mao et al., "SkyServe: Serving AI Models across
Regions and Clouds with Spot Instances", 2024; SkyPilot's `base_ondemand_fallback_replicas`
and `dynamic_ondemand_fallback`). Taken from it:
- an on-demand base that always runs (each on_demand pool's `replicas`);
- spot overprovisioned: each spot pool runs `replicas + overprovision`, counting replicas
  starting and ready, so that a preemption usually leaves the target standing;
- dynamic fallback: on-demand replicas fill the gap while spot is short of its target,
  and are given back once spot is ready again.
Changed here:
- SkyServe sizes the fallback from *ready* spot alone, so it also starts on-demand
  replicas while spot replicas merely boot (at every start and after every preemption).
  Here the fallback is started only for spot that is neither ready nor starting -- spot
  that could not be started (the pool is unavailable after a CapacityUnavailableError) --
  and given back only once spot is *ready* at its target. Between the two bounds the
  fallback is left as it is (hysteresis: no start/stop flapping while spot boots). The
  window a preempted spot replica leaves while its replacement boots is what
  `overprovision` is for.
- SkyServe caps the fallback at the target; here each on_demand pool caps it with its own
  `max_fallback`, and the fallback is spread over the on_demand pools in config order.
- Several named pools of each kind rather than one spot/on-demand pair; placement over
  regions and clouds (SpotHedge's other half) is the provisioner's business.
- Released fallback replicas go newest first (the ones not yet ready before those that
  are); stopping means draining them by migration, so nothing in flight is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

from fleetserve.serve.config.fleet_config import PoolConfig

logger = logging.getLogger(__name__)

Capacity = Literal["spot", "on_demand"]
MemberState = Literal["starting", "ready", "draining", "dead"]


class CapacityUnavailableError(RuntimeError):
    """The pool cannot start a replica now (e.g. the spot market has none); try later."""


@dataclass(frozen=True)
class MemberView:
    """What the pool policy needs of one replica. `starting` is a replica booting that the
    provisioner reports itself (e.g. one it restarts); `draining` and `dead` ones are going
    or gone and are replaced."""

    index: int
    pool: str
    capacity: Capacity
    state: MemberState

    @property
    def alive(self) -> bool:
        return self.state in ("starting", "ready")


@dataclass(frozen=True)
class Start:
    """Start one replica of the pool."""

    pool: str


@dataclass(frozen=True)
class Stop:
    """Drain the replica (its requests migrate), then stop it."""

    index: int


Action = Start | Stop


@dataclass(frozen=True)
class _Slot:
    """A replica the policy counts: a member, or (member None) a start still in flight."""

    member: MemberView | None

    @property
    def release_order(self) -> tuple[bool, float]:
        # Released first: not ready yet (it serves nothing), then the newest (indices are
        # never reused, so the highest is the newest); a start in flight is the newest.
        if self.member is None:
            return (False, -math.inf)
        return (self.member.state == "ready", -self.member.index)


def pool_size(pool: PoolConfig) -> tuple[int, int]:
    """(fewest, most) replicas the pool runs: a spot pool its target + overprovision, an
    on-demand pool its base up to base + max_fallback (on Ray a deployment's bounds, on
    KubeRay its worker group's pods)."""
    if pool.is_spot:
        n = pool.replicas + pool.overprovision
        return n, n
    return pool.replicas, pool.replicas + pool.max_fallback


def _newest(slots: Iterable[_Slot], n: int) -> list[_Slot]:
    return sorted(slots, key=lambda s: s.release_order)[: max(0, n)]


def plan(
    pools: Sequence[PoolConfig],
    members: Iterable[MemberView],
    available: Mapping[str, bool] | None = None,
    pending: Mapping[str, int] | None = None,
) -> list[Action]:
    """The actions that bring the members to the pools' targets, SpotHedge-style.

    `available`: pool name -> whether it can start a replica now (missing: yes); a pool
    that just refused for want of capacity is unavailable until its retry. `pending`: pool
    name -> starts in flight, not yet among `members` (counted as starting; never stopped,
    since they have no index yet: a surplus start is let finish and stopped later).
    Dead, draining and unknown-pool members are not counted, so they get replaced; their
    removal is the caller's (unknown-pool ones still alive are stopped).
    """
    available = available or {}
    pending = pending or {}
    by_pool: dict[str, list[_Slot]] = {p.name: [] for p in pools}
    actions: list[Action] = []
    for m in members:
        if m.pool not in by_pool:
            if m.alive:
                actions.append(Stop(m.index))  # its pool is no longer configured
        elif m.alive:
            by_pool[m.pool].append(_Slot(m))
    for name, n in pending.items():
        if name in by_pool:
            by_pool[name].extend(_Slot(None) for _ in range(n))

    def grow(pool: PoolConfig, want: int) -> None:
        slots = by_pool[pool.name]
        if len(slots) < want and available.get(pool.name, True):
            actions.extend(Start(pool.name) for _ in range(want - len(slots)))
            slots.extend(_Slot(None) for _ in range(want - len(slots)))

    def trim(pool: PoolConfig, want: int) -> None:
        slots = by_pool[pool.name]
        for s in _newest(slots, len(slots) - want):
            slots.remove(s)
            if s.member is not None:
                actions.append(Stop(s.member.index))

    spot = [p for p in pools if p.is_spot]
    on_demand = [p for p in pools if not p.is_spot]
    for p in spot:
        grow(p, p.replicas + p.overprovision)
        trim(p, p.replicas + p.overprovision)
    # Counted after this round's spot starts: a spot start the market may yet grant is not
    # a shortage. One it refuses makes the pool unavailable, and the next round falls back.
    spot_target = sum(p.replicas for p in spot)
    spot_alive = sum(len(by_pool[p.name]) for p in spot)
    spot_ready = sum(
        1 for p in spot for s in by_pool[p.name] if s.member and s.member.state == "ready"
    )
    for p in on_demand:
        grow(p, p.replicas)  # the base always runs
        trim(p, p.replicas + p.max_fallback)

    def extra(p: PoolConfig) -> int:
        return max(0, len(by_pool[p.name]) - p.replicas)

    fallback = sum(extra(p) for p in on_demand)
    # Start fallback while spot (ready or starting) is short of its target; give it back
    # only as far as spot is *ready* at its target.
    low, high = max(0, spot_target - spot_alive), max(0, spot_target - spot_ready)
    want = min(max(fallback, low), high)
    for p in on_demand:
        if want <= fallback:
            break
        room = min(p.max_fallback - extra(p), want - fallback)
        if room > 0 and available.get(p.name, True):
            grow(p, len(by_pool[p.name]) + room)
            fallback += room
    if want < fallback:
        extras = [s for p in on_demand for s in _newest(by_pool[p.name], extra(p))]
        for s in _newest(extras, fallback - want):
            if s.member is not None:
                actions.append(Stop(s.member.index))
    return actions


class CapacityLoad(Protocol):
    """What prefer_spot reads of a replica: its pool's capacity ("spot" or "on_demand")
    and the Router's load figure."""

    @property
    def capacity(self) -> str: ...

    @property
    def num_outstanding_requests(self) -> int: ...


C = TypeVar("C", bound=CapacityLoad)


def prefer_spot(
    candidates: Sequence[C], overload_requests: int, spot_only: bool = False
) -> list[C]:
    """The candidates a request should be routed among: the spot ones with room (fewer
    than `overload_requests` outstanding, the Router's overload rule), since spot capacity
    is the cheap capacity a fleet runs for; every candidate if no spot one has room. A
    class pinned to spot (`spot_only`) gets the spot ones, overloaded or not, and nothing
    when there are none (it waits for spot rather than spend on-demand capacity)."""
    spot = [c for c in candidates if c.capacity == "spot"]
    if spot_only:
        return spot
    room = [c for c in spot if c.num_outstanding_requests < overload_requests]
    return room if room else list(candidates)


class Provisioner(Protocol):
    """Starts and stops the replicas of one model's pools: local engine processes, Ray
    actors on nodes labelled spot / on-demand, pods in node pools.

    `start` returns once the replica is ready, with its index (never reused); by then
    `members` lists it. It raises CapacityUnavailableError when the pool has no capacity
    now; if cancelled (the controller is shutting down) it gives up and cleans up. `stop`
    drains the replica (its requests migrate) and removes it. `members` does not list a
    replica whose `start` is still running: the controller counts those itself."""

    async def start(self, pool: PoolConfig) -> int: ...

    async def stop(self, index: int) -> None: ...

    def members(self) -> list[MemberView]: ...


@dataclass
class PoolCounters:
    """Totals for one pool since the controller started (for metrics)."""

    starts: int = 0
    stops: int = 0
    capacity_failures: int = 0
    start_errors: int = 0  # starts that failed for another reason (also backed off)


class PoolController:
    """Keeps one model's pools at their targets: every `interval_s` (or sooner, when a start
    or stop ends or `poke()` is called) it plans over the provisioner's members and applies
    the actions. Starts and stops run as tasks; a start in flight counts as starting, a
    replica being stopped as draining, so neither is asked for twice. A pool whose start
    failed (CapacityUnavailableError, or any other error) is not started again until a
    backoff has passed (`retry_backoff_s`, doubling per failed round up to
    `max_backoff_s`); while a spot pool waits, the plan falls back to on-demand."""

    def __init__(
        self,
        pools: Sequence[PoolConfig],
        provisioner: Provisioner,
        interval_s: float = 0.5,
        retry_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [p.name for p in pools]
        if not pools or len(set(names)) != len(names):
            raise ValueError(f"pools: at least one, with unique names; got {names}")
        if interval_s <= 0 or retry_backoff_s <= 0 or max_backoff_s < retry_backoff_s:
            raise ValueError(
                "need interval_s > 0 and 0 < retry_backoff_s <= max_backoff_s; got "
                f"{interval_s}, {retry_backoff_s}, {max_backoff_s}"
            )
        self.pools = tuple(pools)
        self.interval_s = interval_s
        self.retry_backoff_s = retry_backoff_s
        self.max_backoff_s = max_backoff_s
        self._provisioner = provisioner
        self._clock = clock
        self._pending: Counter[str] = Counter()  # pool -> starts in flight
        self._stopping: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._failures: dict[str, int] = {}  # pool -> failed rounds in a row
        self._retry_at: dict[str, float] = {}
        self._counters = {name: PoolCounters() for name in names}
        self._wake = asyncio.Event()
        self._stopped = False

    def available(self) -> dict[str, bool]:
        now = self._clock()
        return {p.name: now >= self._retry_at.get(p.name, -math.inf) for p in self.pools}

    def members(self) -> list[MemberView]:
        """The provisioner's members, those this controller is stopping shown as draining."""
        return [
            replace(m, state="draining") if m.index in self._stopping and m.alive else m
            for m in self._provisioner.members()
        ]

    def actions(self) -> list[Action]:
        """What the next round would do."""
        return plan(self.pools, self.members(), self.available(), self._pending)

    def step(self) -> list[Action]:
        """Plans once and launches the actions (as tasks); returns them."""
        members = self.members()
        by_index = {m.index: m for m in members}
        by_name = {p.name: p for p in self.pools}
        actions = plan(self.pools, members, self.available(), self._pending)
        for a in actions:
            if isinstance(a, Start):
                self._pending[a.pool] += 1
                self._spawn(self._start(by_name[a.pool]), f"pool-start-{a.pool}")
            else:
                self._stopping.add(a.index)
                self._spawn(self._stop(by_index[a.index]), f"pool-stop-{a.index}")
        return actions

    def set_target(self, pool: str, replicas: int) -> None:
        """Changes a pool's `replicas` while serving (a gateway's remote pool follows the
        pods a DNS name lists); the next round starts or stops replicas to match."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        names = [p.name for p in self.pools]
        if pool not in names:
            raise KeyError(f"no pool {pool!r}; pools: {names}")
        self.pools = tuple(
            p.model_copy(update={"replicas": replicas}) if p.name == pool else p for p in self.pools
        )
        self.poke()

    def counters(self) -> dict[str, PoolCounters]:
        return {name: replace(c) for name, c in self._counters.items()}

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def poke(self) -> None:
        """Plan now rather than at the next interval (membership changed, e.g. a death)."""
        self._wake.set()

    async def run(self) -> None:
        """The loop, until stop(); then starts in flight are cancelled, stops awaited."""
        try:
            while not self._stopped:
                self._wake.clear()
                self.step()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
        finally:
            for task in self._tasks:
                if task.get_name().startswith("pool-start"):
                    task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def settle(self, timeout_s: float) -> None:
        """Waits until nothing is in flight and the plan is empty (for tests and startup);
        TimeoutError if that takes longer than `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks or self.actions():
            if loop.time() >= deadline:
                raise TimeoutError(
                    f"pools not settled after {timeout_s}s: {len(self._tasks)} in flight, "
                    f"next actions {self.actions()}"
                )
            await asyncio.sleep(min(self.interval_s, 0.02))

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, pool: PoolConfig) -> None:
        try:
            index = await self._provisioner.start(pool)
        except CapacityUnavailableError as e:
            self._counters[pool.name].capacity_failures += 1
            self._back_off(pool.name)
            logger.info("pool %s: no capacity (%s); retry in %.1fs", pool.name, e, self._wait(pool))
        except Exception:
            self._counters[pool.name].start_errors += 1
            self._back_off(pool.name)
            logger.exception("pool %s: start failed; retry in %.1fs", pool.name, self._wait(pool))
        else:
            self._counters[pool.name].starts += 1
            self._failures.pop(pool.name, None)
            self._retry_at.pop(pool.name, None)
            logger.info("pool %s: replica %d ready", pool.name, index)
        finally:
            self._pending[pool.name] -= 1
            self._wake.set()

    async def _stop(self, member: MemberView) -> None:
        try:
            await self._provisioner.stop(member.index)
        except Exception:
            # Not marked stopped: the next round plans over it again.
            logger.exception("pool %s: stopping replica %d failed", member.pool, member.index)
        else:
            if member.pool in self._counters:
                self._counters[member.pool].stops += 1
        finally:
            self._stopping.discard(member.index)
            self._wake.set()

    def _back_off(self, name: str) -> None:
        now = self._clock()
        if self._retry_at.get(name, -math.inf) > now:
            return  # a sibling start of the same round already backed off
        n = self._failures[name] = self._failures.get(name, 0) + 1
        self._retry_at[name] = now + min(self.max_backoff_s, self.retry_backoff_s * 2 ** (n - 1))

    def _wait(self, pool: PoolConfig) -> float:
        return max(0.0, self._retry_at.get(pool.name, 0.0) - self._clock())
