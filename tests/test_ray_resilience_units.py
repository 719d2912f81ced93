"""Fleet III on Ray without a cluster: the ingress's hedged copy (a second call that avoids
the first call's replica; the first answer wins, the loser's call is cancelled), and a
replica's watch over its engine (ray/health.py: hung -> its requests move and it reports
unhealthy; a notice -> it drains, then reports unhealthy). The same on a simulated
cluster: test_ray_resilience.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.serve.handle import DeploymentResponseGenerator  # noqa: E402

from fleetserve.core.sampling_params import SamplingParams  # noqa: E402
from fleetserve.engine.wire import CoreNotice  # noqa: E402
from fleetserve.metrics import ServerMetrics  # noqa: E402
from fleetserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from fleetserve.ray import router_state  # noqa: E402
from fleetserve.ray.clients import RayGenerateClient  # noqa: E402
from fleetserve.ray.health import EngineWatch  # noqa: E402
from fleetserve.serve.config.fleet_config import ResilienceConfig, parse_fleet_config  # noqa: E402
from fleetserve.serve.replicas.supervisor import NOTICE_MARGIN_S  # noqa: E402

DEPLOYMENT = "model-hedge"
MAX_TOKENS = 4


def output(request_id: str, num_tokens: int, tag: int) -> RequestOutput:
    """The delta that brings the answer to `num_tokens` tokens (a replica yields deltas)."""
    ids = [tag + num_tokens - 1]
    done = num_tokens == MAX_TOKENS
    choice = CompletionOutput(0, str(ids), ids, "length" if done else None)
    return RequestOutput(request_id, "p", [1, 2, 3], [choice], finished=done)


class Gen(DeploymentResponseGenerator):
    """One call: its outputs after `delay_s` (tagged by the replica it went to)."""

    def __init__(self, request_id: str, tag: int, delay_s: float) -> None:
        # Serve's own constructor is not run: this stands in for a routed call.
        self.rid, self.tag, self.delay_s = request_id, tag, delay_s
        self.num_read = 0
        self.cancelled_ = False

    async def __anext__(self) -> Any:
        if self.num_read == 0:
            await asyncio.sleep(self.delay_s)
        if self.num_read == MAX_TOKENS:
            raise StopAsyncIteration
        self.num_read += 1
        return output(self.rid, self.num_read, self.tag)

    def cancel(self) -> None:
        self.cancelled_ = True


class Router:
    """What the client asks of FleetRequestRouter."""

    def __init__(self, live: set[int]) -> None:
        self.placed: dict[str, int] = {}
        self.live = live
        self.curr_replicas: dict[str, Any] = {}

    def placement(self, request_id: str) -> int | None:
        return self.placed.get(request_id)

    def has_replica_outside(self, avoid: frozenset[int]) -> bool:
        return bool(self.live - avoid)


class Handle:
    """Sends each call to the first live replica it may go to (its `avoid` respected, as
    the real router does); replica `slow` answers after `slow_s`, the others at once.
    With `route=False` the router never records a placement (calls wait in Serve)."""

    deployment_name = DEPLOYMENT

    def __init__(self, router: Router, slow: int, slow_s: float, route: bool = True) -> None:
        self.router, self.slow, self.slow_s, self.route = router, slow, slow_s, route
        self.calls: list[dict[str, Any]] = []
        self.gens: list[Gen] = []
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, **_: Any) -> Handle:
        return self

    def _remote(self, **kw: Any) -> Gen:
        self.calls.append(kw)
        replica = min(self.router.live - set(kw["avoid"]))
        if self.route:
            self.router.placed[kw["request_id"]] = replica
        delay = self.slow_s if replica == self.slow else 0.0
        gen = Gen(kw["request_id"], 100 * (replica + 1), delay)
        self.gens.append(gen)
        return gen


@pytest.fixture()
def router() -> Iterator[Router]:
    r = Router({0, 1})
    router_state.ROUTERS[DEPLOYMENT] = r
    yield r
    del router_state.ROUTERS[DEPLOYMENT]


def hedged_client(model: str, handle: Handle, max_ongoing: int = 4) -> RayGenerateClient:
    fleet = parse_fleet_config(
        {
            "models": [{"name": "hedge", "model": model}],
            "classes": {"fast": {"hedge_after_s": 0.1}},
        }
    )
    metrics = ServerMetrics().model("hedge")
    return RayGenerateClient(fleet.models[0], fleet, handle, max_ongoing, metrics)  # type: ignore[arg-type]


def read(c: RayGenerateClient) -> tuple[list[RequestOutput], Any]:
    async def main() -> tuple[list[RequestOutput], Any]:
        (stream,) = await c.admit(
            "req", ["hello"], lambda: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        )
        return [out async for out in stream], stream

    return asyncio.run(asyncio.wait_for(main(), 20))


def hedges(c: RayGenerateClient, winner: str) -> float:
    assert c.metrics is not None
    return c.metrics.server.hedges.labels("hedge", winner)._value.get()  # type: ignore[no-any-return]


def test_a_slow_first_call_gets_a_copy_elsewhere_and_the_copy_wins(
    tiny_llama: str, router: Router
) -> None:
    handle = Handle(router, slow=0, slow_s=5.0)
    c = hedged_client(tiny_llama, handle)
    got, stream = read(c)
    # Every output is the copy's (replica 1): the reader sees one call, billed once.
    assert got == [output("req-0", k, 200) for k in range(1, MAX_TOKENS + 1)]
    first, copy = handle.calls
    assert first["avoid"] == [] and copy["avoid"] == [0]  # never on the first's replica
    assert copy["resume"] is None and copy["num_new_tokens"] == first["num_new_tokens"]
    assert handle.gens[0].cancelled_ and not handle.gens[1].cancelled_  # the loser aborted
    assert stream.state.hedged and hedges(c, "copy") == 1 and hedges(c, "first") == 0
    assert c.num_in_flight_streams == 0  # one seat, given back once


def test_the_first_call_wins_over_a_slow_copy(tiny_llama: str, router: Router) -> None:
    # Replica 0 answers after 0.3 s (past the hedge's 0.1 s); the copy, on 1, after 5 s.
    handle = Handle(router, slow=1, slow_s=5.0)
    original = handle._remote

    def first_slowish(**kw: Any) -> Gen:
        gen = original(**kw)
        if len(handle.calls) == 1:
            gen.delay_s = 0.3
        return gen

    handle.generate = SimpleNamespace(remote=first_slowish)
    c = hedged_client(tiny_llama, handle)
    got, stream = read(c)
    assert got[-1] == output("req-0", MAX_TOKENS, 100)
    assert len(handle.calls) == 2 and handle.gens[1].cancelled_
    assert hedges(c, "first") == 1 and c.num_in_flight_streams == 0


@pytest.mark.parametrize("why", ["no_other_replica", "first_not_routed", "budget_full"])
def test_no_copy_when_it_could_not_go_elsewhere(tiny_llama: str, router: Router, why: str) -> None:
    if why == "no_other_replica":
        router.live = {0}
    handle = Handle(router, slow=0, slow_s=0.3, route=why != "first_not_routed")
    # budget_full: one seat in flight at most (the first call holds it): no copy past it.
    c = hedged_client(tiny_llama, handle, max_ongoing=1 if why == "budget_full" else 4)
    got, stream = read(c)
    assert got[-1] == output("req-0", MAX_TOKENS, 100)
    assert len(handle.calls) == 1 and stream.state.hedged  # tried once, then the first alone
    assert hedges(c, "first") == hedges(c, "copy") == 0


# ------------------------------------------------------------------ EngineWatch


class FakeReplica:
    """The LocalReplica surface EngineWatch uses."""

    def __init__(self, held: int) -> None:
        self.num_outstanding_requests = held
        self.last_progress = time.monotonic()
        self.dead_reason: str | None = None
        self.draining = False
        self.on_notice: Any = None
        self.evicted: list[str] = []
        self.stopped: list[bool] = []
        self.drained: list[float] = []

    def hung_for(self, now: float) -> float:
        return 0.0 if self.num_outstanding_requests == 0 else now - self.last_progress

    def evict_all(self, reason: str) -> None:
        self.evicted.append(reason)

    async def stop(self, kill: bool = False) -> None:
        self.stopped.append(kill)
        self.dead_reason = "the engine was killed"

    async def drain(self, timeout_s: float, migrate: bool = True) -> bool:
        self.drained.append(timeout_s)
        self.draining = True
        return False


def watch(replica: FakeReplica, **resilience: Any) -> EngineWatch:
    return EngineWatch("tiny", replica, ResilienceConfig(**resilience))  # type: ignore[arg-type]


def test_a_hung_engine_hands_its_requests_over_and_reports_unhealthy() -> None:
    async def main() -> None:
        replica = FakeReplica(held=2)
        w = watch(replica, hang_timeout_s=5.0)
        start = replica.last_progress
        w.check(start + 4.0)  # not yet
        assert w.health_error() is None and not w.draining and replica.evicted == []
        w.check(start + 5.5)
        assert replica.evicted == ["the replica hung"]  # its streams end "gone": they move
        await asyncio.sleep(0)
        assert replica.stopped == [True]  # killed, as the local supervisor does
        error = w.health_error()
        assert error is not None and "hung" in error and w.draining
        w.check(start + 9.0)
        assert replica.evicted == ["the replica hung"]  # once

    asyncio.run(main())


def test_idle_or_unwatched_engines_are_never_hung() -> None:
    idle = FakeReplica(held=0)
    w = watch(idle, hang_timeout_s=1.0)
    w.check(idle.last_progress + 100.0)
    assert w.health_error() is None
    busy = FakeReplica(held=1)
    w = watch(busy, hang_timeout_s=None)
    w.check(busy.last_progress + 1000.0)
    assert w.health_error() is None and busy.evicted == []


def test_a_notice_drains_within_its_deadline_then_reports_unhealthy() -> None:
    async def main() -> None:
        replica = FakeReplica(held=3)
        w = watch(replica)
        assert replica.on_notice == w.on_notice  # the engine's notices reach the watch
        w.on_notice(replica, CoreNotice("SIGTERM", time.time() + 10.0, "drain within 10 s"))  # type: ignore[arg-type]
        assert w.draining and w.health_error() is None  # serving out its window
        for _ in range(3):
            await asyncio.sleep(0)
        (window,) = replica.drained
        assert 10.0 - NOTICE_MARGIN_S - 1.0 < window <= 10.0 - NOTICE_MARGIN_S
        error = w.health_error()
        assert error is not None and "drained after a notice (SIGTERM" in error
        w.on_notice(replica, CoreNotice("SIGTERM", time.time() + 10.0))  # type: ignore[arg-type]
        assert len(replica.drained) == 1  # a second notice changes nothing

    asyncio.run(main())


def test_the_router_skips_a_draining_replica_while_another_is_listed() -> None:
    from fleetserve.ray.request_router import FleetRequestRouter

    router = FleetRequestRouter.__new__(FleetRequestRouter)  # Serve's setup is not needed
    router._deployment_id = SimpleNamespace(name="model-drain-test")  # type: ignore[assignment]
    router.initialize_state(policy="round_robin")
    try:
        draining = SimpleNamespace(replica_id="r0", routing_stats={"draining": True})
        serving = SimpleNamespace(replica_id="r1", routing_stats={"draining": False})
        pending = SimpleNamespace(
            kwargs={"request_id": "q", "prompt": {"prompt_token_ids": [1]}, "num_new_tokens": 2},
            metadata=SimpleNamespace(internal_request_id="h"),
        )
        for _ in range(3):
            ranks = asyncio.run(router.choose_replicas([draining, serving], pending))  # type: ignore[list-item,arg-type]
            assert [r.replica_id for rank in ranks for r in rank] == ["r1"]
        # Only a draining one: it is picked (its refusal moves the call on).
        ranks = asyncio.run(router.choose_replicas([draining], pending))  # type: ignore[list-item,arg-type]
        assert [r.replica_id for rank in ranks for r in rank] == ["r0"]
    finally:
        router_state.ROUTERS.pop("model-drain-test", None)


def test_least_loaded_counts_a_request_when_it_picks_it() -> None:
    """A burst picked before Serve reports any route spreads over the replicas; the count
    moves with a call Serve sends elsewhere, and a retried pick replaces the earlier one."""
    from fleetserve.ray.request_router import FleetRequestRouter

    router = FleetRequestRouter.__new__(FleetRequestRouter)  # Serve's setup is not needed
    router._deployment_id = SimpleNamespace(name="model-burst-test")  # type: ignore[assignment]
    router.initialize_state(policy="least_loaded")
    try:
        replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats={}) for i in range(2)]
        router._replicas = {r.replica_id: r for r in replicas}  # what Serve lists

        def pending(i: int) -> Any:
            kw = {"request_id": f"q{i}", "prompt": {"prompt_token_ids": [1, 2]},
                  "num_new_tokens": 8}  # fmt: skip
            return SimpleNamespace(kwargs=kw, metadata=SimpleNamespace(internal_request_id=f"h{i}"))

        calls = [pending(i) for i in range(8)]
        picks = []
        for call in calls:
            ranks = asyncio.run(router.choose_replicas(replicas, call))  # type: ignore[arg-type]
            picks.append(ranks[0][0].replica_id)
        assert sorted(picks) == ["r0"] * 4 + ["r1"] * 4
        assert router.outstanding(frozenset()) == [4, 4]
        # Serve routes the first seven where they were picked and the last elsewhere.
        for call, pick in zip(calls[:7], picks[:7], strict=True):
            router.on_request_routed(call, pick, None)  # type: ignore[arg-type]
        other = "r0" if picks[7] == "r1" else "r1"
        router.on_request_routed(calls[7], other, None)  # type: ignore[arg-type]
        counts = dict(zip(["r0", "r1"], router.outstanding(frozenset()), strict=True))
        expected = {r: picks[:7].count(r) + (r == other) for r in ("r0", "r1")}
        assert counts == expected
        # A pick retried (Serve backed off) counts once.
        retry = pending(99)
        for _ in range(3):
            asyncio.run(router.choose_replicas(replicas, retry))  # type: ignore[arg-type]
        assert sum(router.outstanding(frozenset())) == 9
        for call, rid in [*zip(calls[:7], picks[:7], strict=True), (calls[7], other)]:
            router.on_request_completed(rid, call.metadata.internal_request_id)  # type: ignore[arg-type]
        assert sum(router.outstanding(frozenset())) == 1  # the retried pick, not yet routed
    finally:
        router_state.ROUTERS.pop("model-burst-test", None)


# Serve awaits a replica's async __del__; a bare object's is only called by the GC.
@pytest.mark.filterwarnings("ignore:coroutine 'GenerateReplica.__del__' was never awaited")
def test_a_spot_notice_drains_a_ray_replica(tiny_llama: str) -> None:
    """GenerateReplica (no cluster needed) given its pool's notice config: the engine polls
    the (stand-in) GCP metadata server; on preemption the replica drains and refuses new
    calls as `refused` (not a migration move)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "serve"))
    from metadata_standins import GcpMetadataStandIn

    from fleetserve.engine.arg_utils import EngineArgs
    from fleetserve.ray.deployments import GenerateReplica

    async def main() -> None:
        with GcpMetadataStandIn() as meta:
            notice = {"provider": "gcp", "url": meta.url, "poll_interval_s": 0.2}
            args = EngineArgs(model=tiny_llama, max_model_len=128, num_threads=1)
            replica = object.__new__(GenerateReplica)
            await GenerateReplica.__init__(replica, "m", args, ResilienceConfig(), notice)
            try:
                assert not replica.watch.draining
                meta.preempt()
                deadline = time.monotonic() + 30
                while not replica.watch.draining:
                    assert time.monotonic() < deadline, "the notice never drained the replica"
                    await asyncio.sleep(0.1)
                params = SamplingParams(max_tokens=2)
                outs = [
                    o
                    async for o in replica.generate(
                        request_id="late", prompt={"prompt_token_ids": [1, 2]}, params=params,
                        priority=0, num_prompt_tokens=2, num_new_tokens=2, level=0,
                    )
                ]  # fmt: skip
                assert len(outs) == 1 and outs[0].kind == "refused"
            finally:
                await replica.__del__()

    asyncio.run(main())
