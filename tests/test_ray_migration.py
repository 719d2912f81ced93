"""Request migration on Ray without a cluster: the ingress's generate client over a
scripted deployment handle (each call's outputs, or how it fails), the router's exclusion
of the replicas a request was lost on, and a replica's refusals after its engine died.
The same paths on a real (simulated) cluster: test_ray_fleet.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402
from ray.serve.handle import DeploymentResponseGenerator  # noqa: E402

from fleetserve.core.sampling_params import SamplingParams  # noqa: E402
from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError  # noqa: E402
from fleetserve.metrics import ServerMetrics  # noqa: E402
from fleetserve.outputs import CompletionOutput, RequestOutput, fold  # noqa: E402
from fleetserve.ray import router_state  # noqa: E402
from fleetserve.ray.clients import RayGenerateClient  # noqa: E402
from fleetserve.ray.wire import RemoteError  # noqa: E402
from fleetserve.serve.admission.admit import ShedError  # noqa: E402
from fleetserve.serve.config.fleet_config import parse_fleet_config  # noqa: E402
from fleetserve.serve.resilience.migration import MigrationLimitError  # noqa: E402

DEPLOYMENT = "model-migr"
MAX_TOKENS = 6


def output(request_id: str, num_tokens: int) -> RequestOutput:
    """The delta that brings the request to `num_tokens` tokens (token t is 100 + t), as
    a replica yields it."""
    ids = [100 + num_tokens - 1]
    done = num_tokens == MAX_TOKENS
    text = "".join(f"<{t}>" for t in ids)
    choice = CompletionOutput(0, text, ids, "length" if done else None)
    return RequestOutput(request_id, "p", [1, 2, 3], [choice], finished=done)


class ScriptedGen(DeploymentResponseGenerator):
    """One call's stream: the outputs a replica would give from `start` tokens on, with
    `fail` raised (or sent, for a RemoteError) after `fail_after` of them."""

    def __init__(self, request_id: str, start: int, fail: Any, fail_after: int) -> None:
        # Serve's own constructor is not run: this stands in for a routed call.
        self.items: list[Any] = [output(request_id, k) for k in range(start + 1, MAX_TOKENS + 1)]
        if fail is not None:
            self.items[fail_after:] = [fail]
        self.cancelled_ = False

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled_ = True


class ScriptedHandle:
    """A deployment handle whose k-th call goes to replica `replicas[k]` (as the router
    records it) and fails as `failures[k]` says: (error, after how many outputs)."""

    deployment_name = DEPLOYMENT

    def __init__(self, replicas: list[int], failures: list[tuple[Any, int] | None]) -> None:
        self.replicas, self.failures = replicas, failures
        self.calls: list[dict[str, Any]] = []
        self.gens: list[ScriptedGen] = []
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, **_: Any) -> ScriptedHandle:
        return self

    def _remote(self, **kw: Any) -> ScriptedGen:
        k = len(self.calls)
        self.calls.append(kw)
        ROUTER.placed[kw["request_id"]] = self.replicas[k]
        resume = kw["resume"]
        start = 0 if resume is None else len(resume.outputs[0].token_ids)
        fail, after = self.failures[k] if k < len(self.failures) and self.failures[k] else (None, 0)
        gen = ScriptedGen(kw["request_id"], start, fail, after)
        self.gens.append(gen)
        return gen


class FakeRouter:
    """What the client asks of FleetRequestRouter: placements and live replicas."""

    def __init__(self) -> None:
        self.placed: dict[str, int] = {}
        self.live = {0, 1}
        self.curr_replicas: dict[str, Any] = {}

    def placement(self, request_id: str) -> int | None:
        return self.placed.get(request_id)

    def has_replica_outside(self, avoid: frozenset[int]) -> bool:
        return bool(self.live - avoid)


ROUTER = FakeRouter()


@pytest.fixture(autouse=True)
def fake_router() -> Iterator[FakeRouter]:
    global ROUTER
    ROUTER = FakeRouter()
    router_state.ROUTERS[DEPLOYMENT] = ROUTER
    yield ROUTER
    del router_state.ROUTERS[DEPLOYMENT]


def client(model: str, handle: ScriptedHandle, **resilience: Any) -> RayGenerateClient:
    fleet = parse_fleet_config(
        {"models": [{"name": "migr", "model": model, "resilience": resilience}]}
    )
    return RayGenerateClient(fleet.models[0], fleet, handle, 4)  # type: ignore[arg-type]


async def read_all(c: RayGenerateClient) -> tuple[list[RequestOutput], BaseException | None]:
    (stream,) = await c.admit(
        "req", ["hello"], lambda: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    )
    got: list[RequestOutput] = []
    try:
        async for out in stream:
            got.append(out)
    except Exception as e:  # noqa: BLE001 -- returned for the test to check
        return got, e
    return got, None


def test_a_lost_actor_resumes_on_another_replica(tiny_llama: str) -> None:
    handle = ScriptedHandle([0, 1], [(ActorDiedError(), 2)])
    c = client(tiny_llama, handle)
    got, error = asyncio.run(read_all(c))
    assert error is None
    # The reader saw one stream: every token once, in order, as if nothing happened.
    assert [t for o in got for t in o.outputs[0].token_ids] == [100 + t for t in range(6)]
    assert got[-1] == output("req-0", MAX_TOKENS)
    first, second = handle.calls
    assert first["resume"] is None and first["avoid"] == []
    assert second["resume"] == fold(got[:2])  # the whole answer its reader had
    assert second["avoid"] == [0]  # never back to the replica it was lost on
    assert second["num_new_tokens"] == first["num_new_tokens"] - 2
    assert handle.gens[0].cancelled_  # the lost call is let go
    assert c.num_in_flight_streams == 0  # its seat is back


def test_an_engine_death_resumes_and_a_refusal_does_not(tiny_llama: str) -> None:
    gone = RemoteError.of(ReplicaGoneError("the engine process exited (code -9)"))
    handle = ScriptedHandle([1, 0], [(gone, 3)])
    got, error = asyncio.run(read_all(client(tiny_llama, handle)))
    assert error is None and got[-1] == output("req-0", MAX_TOKENS)
    assert handle.calls[1]["avoid"] == [1]

    bad = RemoteError.of(ValueError("bad max_tokens"))
    handle = ScriptedHandle([0], [(bad, 0)])
    got, error = asyncio.run(read_all(client(tiny_llama, handle)))
    assert isinstance(error, ValueError) and len(handle.calls) == 1


def test_past_the_migration_limit_the_request_fails_clearly(tiny_llama: str) -> None:
    # Every call loses its replica after one output; the limit allows two moves.
    handle = ScriptedHandle([0, 1, 2], [(ActorDiedError(), 1)] * 3)
    c = client(tiny_llama, handle, migration_limit=2)
    ROUTER.live = {0, 1, 2, 3}
    got, error = asyncio.run(read_all(c))
    assert isinstance(error, MigrationLimitError), error
    assert "migration_limit of 2" in str(error)
    assert len(got) == 3 and len(handle.calls) == 3
    assert handle.calls[2]["avoid"] == [0, 1]  # every replica it was lost on
    assert c.num_in_flight_streams == 0


def test_with_no_other_replica_it_waits_migration_wait_s(tiny_llama: str) -> None:
    handle = ScriptedHandle([0, 1], [(ActorDiedError(), 1)])
    c = client(tiny_llama, handle, migration_wait_s=0.3)
    ROUTER.live = {0}  # Serve lists only the lost replica, and starts none

    got, error = asyncio.run(read_all(c))
    assert isinstance(error, EngineDeadError) and "migration_wait_s" in str(error), error
    assert len(handle.calls) == 1 and c.num_in_flight_streams == 0

    async def replica_comes_back() -> tuple[list[RequestOutput], BaseException | None]:
        ROUTER.live = {0}
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, lambda: setattr(ROUTER, "live", {0, 1}))
        return await read_all(client(tiny_llama, ScriptedHandle([0, 1], [(ActorDiedError(), 1)])))

    got, error = asyncio.run(replica_comes_back())
    assert error is None and got[-1] == output("req-0", MAX_TOKENS)


def test_the_ingress_queue_sheds_when_full_and_past_max_queue_time_s(tiny_llama: str) -> None:
    fleet = parse_fleet_config(
        {
            "classes": {"interactive": {"max_waiting": 1, "max_queue_time_s": 0.2}},
            "models": [{"name": "migr", "model": tiny_llama}],
        }
    )
    handle = ScriptedHandle([0, 0], [])
    metrics = ServerMetrics().model("migr")
    c = RayGenerateClient(fleet.models[0], fleet, handle, 1, metrics)  # type: ignore[arg-type]

    def params() -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    async def main() -> None:
        (running,) = await c.admit("a", ["hello"], params)  # the model's one seat
        queued = asyncio.create_task(c.admit("b", ["hello"], params))
        await asyncio.sleep(0)
        assert c.waiting_by_class() == {"interactive": 1}
        with pytest.raises(ShedError, match="'interactive' queue is full") as full:
            await c.admit("c", ["hello"], params)
        assert full.value.code == "overloaded"
        with pytest.raises(ShedError, match="waited 0.2 s in the 'interactive' queue") as late:
            await queued
        assert late.value.code == "queue_timeout"
        assert [call["request_id"] for call in handle.calls] == ["a-0"]  # never sent
        text = metrics.server.render().decode()
        assert 'reason="queue_full"} 1.0' in text and 'reason="queue_timeout"} 1.0' in text
        # A cancelled wait leaves the queue; abort_all fails what is queued.
        left = asyncio.create_task(c.admit("d", ["hello"], params))
        await asyncio.sleep(0)
        left.cancel()
        await asyncio.sleep(0)
        assert c.num_in_flight == 1
        aborted = asyncio.create_task(c.admit("e", ["hello"], params))
        await asyncio.sleep(0)
        c.abort_all("stopping")
        with pytest.raises(EngineDeadError, match="stopping"):
            await aborted
        running.close()  # its seat back: the next request is sent at once
        assert c.num_in_flight == 0
        (after,) = await c.admit("f", ["hello"], params)
        assert [call["request_id"] for call in handle.calls] == ["a-0", "f-0"]
        after.close()

    asyncio.run(main())


def pending(kwargs: dict[str, Any]) -> Any:
    return SimpleNamespace(kwargs=kwargs, metadata=SimpleNamespace(internal_request_id="http-1"))


def test_the_router_never_picks_a_replica_the_request_was_lost_on() -> None:
    from fleetserve.ray.request_router import FleetRequestRouter, route_of

    router = FleetRequestRouter.__new__(FleetRequestRouter)  # Serve's setup is not needed
    router._deployment_id = SimpleNamespace(name="model-router-test")  # type: ignore[assignment]
    router.initialize_state(policy="least_loaded")
    try:
        replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats={}) for i in range(2)]
        kw: dict[str, Any] = {
            "request_id": "req-0",
            "prompt": {"prompt_token_ids": [1, 2, 3]},
            "num_new_tokens": 8,
        }
        (first,) = asyncio.run(router.choose_replicas(replicas, pending(kw)))[0]  # type: ignore[arg-type]
        router.on_request_routed(pending(kw), first.replica_id, None)  # type: ignore[arg-type]
        lost = router.placement("req-0")
        assert lost == router.index_of(first.replica_id)

        resume = fold([output("req-0", 1), output("req-0", 2)])
        moved = {**kw, "resume": resume, "avoid": [lost]}
        ranks = asyncio.run(router.choose_replicas(replicas, pending(moved)))  # type: ignore[arg-type]
        assert [r.replica_id for rank in ranks for r in rank] == [
            r.replica_id for r in replicas if r is not first
        ]
        route = route_of(pending(moved))  # type: ignore[arg-type]
        assert route is not None and route.prompt_token_ids == (1, 2, 3, 100, 101)
        # Only replicas it was lost on: none is picked (Serve tries again later).
        only = [first]
        assert asyncio.run(router.choose_replicas(only, pending(moved))) == []  # type: ignore[arg-type]
    finally:
        router_state.ROUTERS.pop("model-router-test", None)


def test_a_replica_whose_engine_died_refuses_as_gone() -> None:
    from fleetserve.ray.deployments import lost_as_gone

    dead = SimpleNamespace(dead_reason="the engine process exited", draining=False)
    assert isinstance(lost_as_gone(EngineDeadError("dead"), dead), ReplicaGoneError)
    assert type(lost_as_gone(ValueError("bad"), dead)) is ValueError
    stopping = SimpleNamespace(dead_reason=None, draining=True)
    assert isinstance(lost_as_gone(EngineDeadError("stopped"), stopping), ReplicaGoneError)
    alive = SimpleNamespace(dead_reason=None, draining=False)
    assert type(lost_as_gone(EngineDeadError("x"), alive)) is EngineDeadError
    remote = RemoteError.of(ReplicaGoneError("stopped"))
    assert remote.kind == "gone" and type(remote.exception(batch=False)) is ReplicaGoneError
