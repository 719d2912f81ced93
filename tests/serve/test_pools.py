"""Spot and on-demand pools: the SpotHedge-style plan (exact actions for each situation,
plus invariants over random fleets), the controller against an in-memory provisioner, and
spot-first routing.

The fake provisioner stands in for a cloud's spot market, which cannot run here: its spot
capacity is switched off and on by the test, and a start it cannot grant raises
CapacityUnavailableError the way a cloud's "insufficient capacity" answer would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.serve.config.fleet_config import PoolConfig
from fleetserve.serve.replicas.pool_plan import (
    CapacityUnavailableError,
    MemberView,
    PoolController,
    Start,
    Stop,
    plan,
    prefer_spot,
)

SPOT = PoolConfig(name="spot", capacity="spot", replicas=3, overprovision=1)
BASE = PoolConfig(name="base", capacity="on_demand", replicas=1, max_fallback=3)
POOLS = [SPOT, BASE]


def edit(pool: PoolConfig, **fields: object) -> PoolConfig:
    return PoolConfig.model_validate({**pool.model_dump(), **fields})


def spot(index: int, state: str = "ready") -> MemberView:
    return MemberView(index, "spot", "spot", state)  # type: ignore[arg-type]


def od(index: int, state: str = "ready", pool: str = "base") -> MemberView:
    return MemberView(index, pool, "on_demand", state)  # type: ignore[arg-type]


def steady() -> list[MemberView]:
    """Spot at target + overprovision (indices 0-3), the base (4): nothing to do."""
    return [spot(0), spot(1), spot(2), spot(3), od(4)]


# ---- plan --------------------------------------------------------------------------


def test_initial_fill_starts_spot_with_margin_and_the_base() -> None:
    # No on-demand fallback for spot that is being started: only for spot refused.
    assert plan(POOLS, []) == [Start("spot")] * 4 + [Start("base")]
    assert plan(POOLS, steady()) == []


def test_one_preemption_is_absorbed_by_the_overprovision() -> None:
    members = [spot(0, "dead"), *steady()[1:]]
    assert plan(POOLS, members) == [Start("spot")]  # replaced; 3 ready spot still serve


def test_spot_preempted_while_the_market_is_out_falls_back() -> None:
    members = [spot(0, "dead"), spot(1, "dead"), spot(2), spot(3), od(4)]
    # 2 spot left of a target of 3: one on-demand replica holds the target.
    assert plan(POOLS, members, available={"spot": False}) == [Start("base")]
    # Spot that can be started is started instead (the margin covers the boot).
    assert plan(POOLS, members) == [Start("spot"), Start("spot")]


def test_spot_unavailable_falls_back_up_to_max_fallback() -> None:
    big = edit(SPOT, replicas=6)
    assert plan([big, BASE], [], available={"spot": False}) == [Start("base")] * 4
    # Already at base + max_fallback: nothing more, however short spot is.
    members = [od(0), od(1), od(2), od(3)]
    assert plan([big, BASE], members, available={"spot": False}) == []


def test_fallback_is_kept_while_spot_boots_and_released_newest_first() -> None:
    fallback = [od(4), od(7), od(8)]  # 4 is the base; 7 and 8 were started as fallback
    booting = [spot(9, "starting"), spot(10, "starting"), spot(11, "starting")]
    # Spot is back in the market and booting: fallback stays (no flapping).
    assert plan(POOLS, [*booting, spot(12, "starting"), *fallback]) == []
    # Two spot ready: the target still needs one more; the newest fallback goes.
    two = [spot(9), spot(10), spot(11, "starting"), spot(12, "starting")]
    assert plan(POOLS, [*two, *fallback]) == [Stop(8)]
    # Spot ready at its target: every fallback replica goes, newest first; the base stays.
    ready = [spot(9), spot(10), spot(11), spot(12, "starting")]
    assert plan(POOLS, [*ready, *fallback]) == [Stop(8), Stop(7)]


def test_fallback_not_yet_ready_is_released_before_a_ready_one() -> None:
    members = [*steady(), od(5, "starting"), od(6)]
    assert plan(POOLS, members) == [Stop(5), Stop(6)]
    base = [od(4), od(5), od(6, "starting")]
    out = {"spot": False}
    assert plan(POOLS, [spot(0), *base], available=out) == []  # 2 short, 2 fallback
    # One fallback too many once a spot replica came back: the one still starting goes.
    assert plan(POOLS, [spot(0), spot(1), *base], available=out) == [Stop(6)]


def test_dead_and_draining_members_are_replaced() -> None:
    members = [*steady()[:4], od(4, "dead"), od(5, "draining")]
    assert plan(POOLS, members) == [Start("base")]
    members = [spot(0, "draining"), *steady()[1:]]
    assert plan(POOLS, members) == [Start("spot")]


def test_overprovision_is_kept_and_surplus_spot_stopped_newest_first() -> None:
    members = [*steady(), spot(5), spot(6, "starting")]
    assert plan(POOLS, members) == [Stop(6), Stop(5)]
    assert plan([edit(SPOT, overprovision=0), BASE], steady()) == [Stop(3)]
    assert plan([edit(SPOT, overprovision=2), BASE], steady()) == [Start("spot")]


def test_starts_in_flight_count_and_are_not_stopped() -> None:
    assert plan(POOLS, [], pending={"spot": 4, "base": 1}) == []
    assert plan(POOLS, [spot(0)], pending={"spot": 2}) == [Start("spot"), Start("base")]
    # A fallback start in flight is the surplus once spot is back: it is let finish (and
    # stopped then) rather than stopping a ready replica in its place.
    assert plan(POOLS, [*steady(), od(5)], pending={"base": 1}) == [Stop(5)]
    assert plan(POOLS, steady(), pending={"base": 1}) == []


def test_fallback_spreads_over_on_demand_pools_in_order() -> None:
    a = PoolConfig(name="a", capacity="on_demand", replicas=0, max_fallback=2)
    b = PoolConfig(name="b", capacity="on_demand", replicas=1, max_fallback=5)
    pools = [edit(SPOT, replicas=5, overprovision=0), a, b]
    assert (
        plan(pools, [], available={"spot": False})
        == [Start("b")] + [Start("a")] * 2 + [Start("b")] * 3
    )
    # With "a" out of capacity too, "b" takes what it can.
    no_a = {"spot": False, "a": False}
    assert plan(pools, [], available=no_a) == [Start("b")] + [Start("b")] * 5
    # Release is newest first across the pools, never below a base.
    members = [spot(0), spot(1), spot(2), spot(3), spot(4)]
    members += [od(5, pool="b"), od(6, pool="a"), od(7, pool="b"), od(8, pool="a")]
    assert plan(pools, members) == [Stop(8), Stop(7), Stop(6)]


def test_members_of_an_unknown_pool_are_stopped() -> None:
    members = [*steady(), od(9, pool="gone"), od(10, "dead", pool="gone")]
    assert plan(POOLS, members) == [Stop(9)]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[PoolConfig], list[MemberView], dict[str, bool]]:
    pools = [
        PoolConfig(
            name=f"s{i}",
            capacity="spot",
            replicas=draw(st.integers(0, 4)),
            overprovision=draw(st.integers(0, 2)),
        )
        for i in range(draw(st.integers(0, 2)))
    ]
    pools += [
        PoolConfig(
            name=f"o{i}",
            capacity="on_demand",
            replicas=draw(st.integers(0, 3)),
            max_fallback=draw(st.integers(0, 3)),
        )
        for i in range(draw(st.integers(1, 2)))
    ]
    states = st.sampled_from(["starting", "ready", "ready", "draining", "dead"])
    members = [
        MemberView(i, p.name, p.capacity, draw(states))
        for i, p in enumerate(draw(st.lists(st.sampled_from(pools), max_size=16)))
    ]
    available = {p.name: draw(st.booleans()) for p in pools}
    return pools, members, available


def alive(pool: PoolConfig, members: Sequence[MemberView]) -> int:
    return sum(1 for m in members if m.pool == pool.name and m.alive)


@given(fleets())
@settings(max_examples=300, deadline=None)
def test_plan_invariants(fleet: tuple[list[PoolConfig], list[MemberView], dict[str, bool]]) -> None:
    pools, members, available = fleet
    actions = plan(pools, members, available)
    starts = [a.pool for a in actions if isinstance(a, Start)]
    stops = [a.index for a in actions if isinstance(a, Stop)]
    by_index = {m.index: m for m in members}
    assert len(set(stops)) == len(stops) and all(by_index[i].alive for i in stops)
    assert all(available[p] for p in starts)  # nothing started where capacity is out
    after = [m for m in members if m.index not in stops]
    capacity = {p.name: p.capacity for p in pools}
    after += [MemberView(100 + i, p, capacity[p], "starting") for i, p in enumerate(starts)]
    spot_target = sum(p.replicas for p in pools if p.is_spot)
    spot_alive = sum(alive(p, after) for p in pools if p.is_spot)
    spot_ready = sum(1 for m in after if m.capacity == "spot" and m.state == "ready")
    fallback = 0
    for p in pools:
        n, before = alive(p, after), alive(p, members)
        assert not (p.name in starts and p.name in [by_index[i].pool for i in stops])
        if p.is_spot:
            want = p.replicas + p.overprovision
            assert n == want or (n < want and not available[p.name] and n == before)
        else:
            # Never below the base (unless the base cannot start now), never over the cap.
            assert n >= min(before, p.replicas) and (n >= p.replicas or not available[p.name])
            assert n <= max(before, p.replicas + p.max_fallback)
            fallback += max(0, n - p.replicas)
    # Fallback: enough to cover spot that is neither ready nor starting (as far as the
    # caps and capacity allow), no more than spot lacks in ready replicas.
    cap = sum(p.max_fallback for p in pools if not p.is_spot and available[p.name])
    assert fallback >= min(spot_target - spot_alive, cap) or spot_target <= spot_alive
    assert fallback <= max(0, spot_target - spot_ready)
    # Planning again once the actions are under way asks for nothing more.
    assert plan(pools, after, available) == []


# ---- PoolController against a fake spot market ------------------------------------------


class FakeCloud:
    """A Provisioner over an in-memory "cloud": starting takes `boot_s`; a spot pool's start
    raises CapacityUnavailableError while `spot_open` is false; `preempt` kills a replica
    the way a spot reclaim does (it stays listed as dead: removing it is the caller's)."""

    def __init__(self, boot_s: float = 0.01) -> None:
        self.boot_s = boot_s
        self.spot_open = True
        self.fail_next: Exception | None = None
        self.stop_fails = 0
        self.started: list[str] = []  # every start call, by pool
        self.cancelled = 0
        self._members: dict[int, MemberView] = {}
        self._next = 0

    async def start(self, pool: PoolConfig) -> int:
        self.started.append(pool.name)
        try:
            await asyncio.sleep(self.boot_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        if pool.is_spot and not self.spot_open:
            raise CapacityUnavailableError(f"{pool.name}: no spot capacity in the zone")
        index, self._next = self._next, self._next + 1
        self._members[index] = MemberView(index, pool.name, pool.capacity, "ready")
        return index

    async def stop(self, index: int) -> None:
        if self.stop_fails:
            self.stop_fails -= 1
            raise RuntimeError("drain timed out")
        m = self._members[index]
        self._members[index] = MemberView(m.index, m.pool, m.capacity, "draining")
        await asyncio.sleep(0)
        del self._members[index]

    def members(self) -> list[MemberView]:
        return list(self._members.values())

    def preempt(self, capacity: str = "spot") -> None:
        for i, m in self._members.items():
            if m.capacity == capacity and m.state == "ready":
                self._members[i] = MemberView(m.index, m.pool, m.capacity, "dead")

    def alive(self, pool: str) -> list[int]:
        return sorted(m.index for m in self._members.values() if m.pool == pool and m.alive)


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def controller(cloud: FakeCloud, clock: Clock, **kw: float) -> PoolController:
    return PoolController(POOLS, cloud, interval_s=0.01, retry_backoff_s=1.0, max_backoff_s=4.0,
                          clock=clock, **kw)  # fmt: skip


def test_controller_falls_back_while_spot_is_out_and_gives_it_back() -> None:
    async def scenario() -> None:
        cloud, clock = FakeCloud(), Clock()
        ctl = controller(cloud, clock)
        loop = asyncio.create_task(ctl.run())
        await ctl.settle(5.0)
        assert len(cloud.alive("spot")) == 4 and cloud.alive("base") == [4]
        base = cloud.alive("base")

        # The market runs dry and every spot replica is reclaimed.
        cloud.spot_open = False
        cloud.preempt()
        ctl.poke()
        await ctl.settle(5.0)
        assert cloud.alive("spot") == []
        # The target (3 spot) is held by on-demand, as far as max_fallback (3) allows.
        assert len(cloud.alive("base")) == 4 and cloud.alive("base")[0] == base[0]
        assert ctl.available() == {"spot": False, "base": True}
        counts = ctl.counters()
        assert counts["spot"].capacity_failures == 4 and counts["base"].starts == 4

        # Spot comes back; once the backoff has passed it is started again, and once it is
        # ready the fallback goes (newest first), the base stays.
        cloud.spot_open = True
        clock.now += 1.0
        ctl.poke()
        await ctl.settle(5.0)
        assert len(cloud.alive("spot")) == 4 and cloud.alive("base") == base
        counts = ctl.counters()
        assert counts["spot"].starts == 8 and counts["base"].stops == 3
        ctl.stop()
        await loop

    asyncio.run(scenario())


def test_backoff_doubles_per_failed_round_up_to_the_cap() -> None:
    async def retry_wait(ctl: PoolController, clock: Clock) -> float:
        await ctl.settle(5.0)  # the round failed (and the fallback filled)
        start = clock.now
        while not ctl.available()["spot"]:
            clock.now += 0.25
        ctl.poke()
        return clock.now - start

    async def scenario() -> None:
        cloud, clock = FakeCloud(), Clock()
        cloud.spot_open = False
        ctl = controller(cloud, clock)
        loop = asyncio.create_task(ctl.run())
        waits = [await retry_wait(ctl, clock) for _ in range(5)]
        # Four concurrent spot starts fail per round, but the round backs off once.
        assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
        await ctl.settle(5.0)
        assert ctl.counters()["spot"].capacity_failures == 24
        cloud.spot_open = True
        clock.now += 4.0
        ctl.poke()
        await ctl.settle(5.0)
        assert ctl.available()["spot"] and len(cloud.alive("spot")) == 4
        # A success resets the backoff.
        cloud.spot_open = False
        cloud.preempt()
        ctl.poke()
        assert await retry_wait(ctl, clock) == 1.0
        ctl.stop()
        await loop

    asyncio.run(scenario())


def test_a_start_in_flight_is_not_repeated_and_stop_cancels_it() -> None:
    async def scenario() -> None:
        cloud = FakeCloud(boot_s=60.0)
        ctl = controller(cloud, Clock())
        assert ctl.step() == [Start("spot")] * 4 + [Start("base")]
        await asyncio.sleep(0)
        assert ctl.step() == [] and ctl.in_flight == 5
        loop = asyncio.create_task(ctl.run())
        await asyncio.sleep(0.05)
        assert sorted(cloud.started) == ["base"] + ["spot"] * 4  # still, after many rounds
        ctl.stop()
        await loop
        assert cloud.cancelled == 5 and ctl.in_flight == 0 and cloud.members() == []

    asyncio.run(scenario())


def test_other_start_errors_back_off_too_and_failed_stops_are_retried() -> None:
    async def scenario() -> None:
        cloud, clock = FakeCloud(), Clock()
        ctl = PoolController([BASE], cloud, interval_s=0.01, clock=clock)
        cloud.fail_next = RuntimeError("engine process exited with code 1")
        loop = asyncio.create_task(ctl.run())
        await ctl.settle(5.0)
        assert cloud.members() == [] and not ctl.available()["base"]
        assert ctl.counters()["base"].start_errors == 1
        clock.now += 1.0
        await ctl.settle(5.0)
        assert cloud.alive("base") == [0]
        # A surplus replica whose drain fails once is stopped on a later round.
        cloud.stop_fails = 1
        await cloud.start(BASE)
        await ctl.settle(5.0)
        assert cloud.alive("base") == [0] and cloud.stop_fails == 0
        assert ctl.counters()["base"].stops == 1
        ctl.stop()
        await loop

    asyncio.run(scenario())


def test_controller_refuses_bad_arguments() -> None:
    cloud = FakeCloud()
    with pytest.raises(ValueError, match="unique names"):
        PoolController([BASE, BASE], cloud)
    with pytest.raises(ValueError, match="retry_backoff_s <= max_backoff_s"):
        PoolController(POOLS, cloud, retry_backoff_s=10.0, max_backoff_s=1.0)


# ---- prefer_spot ------------------------------------------------------------------------


@dataclass(frozen=True)
class R:
    index: int
    capacity: str
    num_outstanding_requests: int


def test_prefer_spot() -> None:
    s0, s1, o2 = R(0, "spot", 3), R(1, "spot", 8), R(2, "on_demand", 0)
    # Spot replicas with room take the request, even if on-demand is idler.
    assert prefer_spot([s0, s1, o2], overload_requests=8) == [s0]
    # Every spot replica full: everything is a candidate (the policy picks the idlest).
    assert prefer_spot([R(0, "spot", 8), s1, o2], overload_requests=8) == [
        R(0, "spot", 8), s1, o2]  # fmt: skip
    assert prefer_spot([o2], overload_requests=8) == [o2]
    # A class pinned to spot gets spot only, full or not, and nothing without spot.
    assert prefer_spot([s1, o2], overload_requests=8, spot_only=True) == [s1]
    assert prefer_spot([o2], overload_requests=8, spot_only=True) == []
