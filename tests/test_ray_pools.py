"""Spot and on-demand pools on Ray without a cluster: a model's pools as Serve deployments
(names, resources, sizes), the pools' autoscaling policy deciding the on-demand fallback
(serve/replicas/pool_plan.py's plan() over what Serve runs), the ingress's choice of deployment per
call, and a request lost with its spot replica resuming on an on-demand one. The same on
a (simulated) cluster: test_ray_pools_cluster.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402

from fleetserve.core.sampling_params import SamplingParams  # noqa: E402
from fleetserve.outputs import fold  # noqa: E402
from fleetserve.ray import pool_state, router_state  # noqa: E402
from fleetserve.ray.clients import RayGenerateClient  # noqa: E402
from fleetserve.ray.pool_deployments import (  # noqa: E402
    RESOURCE_PER_REPLICA,
    PoolChoice,
    PoolPolicy,
    PoolRoute,
    ReplicaRoom,
    choose_deployment,
    decide,
    pool_options,
    served_pools,
)
from fleetserve.ray.pool_state import PoolSnapshot  # noqa: E402
from fleetserve.serve.config.fleet_config import PoolConfig, parse_fleet_config  # noqa: E402
from test_ray_migration import MAX_TOKENS, ScriptedGen, output  # noqa: E402

SPOT = PoolConfig(name="spot", capacity="spot", replicas=2, overprovision=1)
BASE = PoolConfig(name="base", capacity="on_demand", replicas=1, max_fallback=2)


def pools_fleet(model: str | None = None, **placement: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": "chat",
        "pools": [
            SPOT.model_dump(exclude_none=True),
            BASE.model_dump(exclude_none=True),
            {"name": "idle", "capacity": "on_demand", "replicas": 0},
        ],
        "engine": {"max_num_seqs": 4},
        "placement": {"num_cpus": 1, "resources": {"gpu_kind_a": 1}, **placement},
    }
    if model is not None:
        entry["model"] = model
    return {
        "models": [entry],
        "classes": {"interactive": {}, "batch": {"priority": 10, "capacity": "spot"}},
        "default_class": "interactive",
    }


def test_each_pool_is_a_deployment_on_nodes_with_its_resource(tiny_llama: str) -> None:
    from fleetserve.ray.app import build_app, ingress_actor_options, model_options

    cfg = parse_fleet_config(pools_fleet(tiny_llama, spot_resource="preemptible"))
    entry = cfg.models[0]
    assert [p.name for p in served_pools(entry)] == ["spot", "base"]  # "idle" never runs one
    model_opts, _ = model_options(entry)
    spot = pool_options(entry, entry.pools[0], model_opts, 1.0)  # type: ignore[index]
    base = pool_options(entry, entry.pools[1], model_opts, 1.0)  # type: ignore[index]
    assert (spot["name"], base["name"]) == ("model-chat--spot", "model-chat--base")
    assert spot["ray_actor_options"] == {
        "num_cpus": 1,
        "resources": {"gpu_kind_a": 1, "preemptible": RESOURCE_PER_REPLICA},
    }
    assert base["ray_actor_options"]["resources"] == {
        "gpu_kind_a": 1,
        "on_demand": RESOURCE_PER_REPLICA,
    }
    for opts, sizes in ((spot, (3, 3, 3)), (base, (1, 1, 3))):
        auto = opts["autoscaling_config"]
        assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == sizes
        assert auto["policy"]["policy_function"] is PoolPolicy
        assert "num_replicas" not in opts
    kwargs = base["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs["pool"] == "base" and kwargs["spot_pending_s"] == 30.0
    assert kwargs["deployments"] == {"spot": "model-chat--spot", "base": "model-chat--base"}
    assert base["request_router_config"] == model_opts["request_router_config"]
    assert build_app(cfg) is not None  # accepted: pools are served on Ray
    # The ingress (every stream passes it) stays off spot nodes.
    assert ingress_actor_options(cfg) == {
        "num_cpus": 0,
        "resources": {"on_demand": RESOURCE_PER_REPLICA},
    }
    plain = parse_fleet_config({"models": [{"name": "m", "model": tiny_llama}]})
    assert ingress_actor_options(plain) == {"num_cpus": 0}

    labelled = parse_fleet_config(pools_fleet(tiny_llama, spot_labels={"market": "spot"}))
    entry = labelled.models[0]
    spot = pool_options(entry, entry.pools[0], model_options(entry)[0], 1.0)  # type: ignore[index]
    assert spot["ray_actor_options"] == {
        "num_cpus": 1,
        "resources": {"gpu_kind_a": 1},
        "label_selector": {"market": "spot"},
    }
    with pytest.raises(ValueError, match=r"models\[0\].placement.*must differ"):
        parse_fleet_config(pools_fleet(spot_resource="on_demand"))
    with pytest.raises(ValueError, match=r"models\[0\].placement.*custom resource name"):
        parse_fleet_config(pools_fleet(on_demand_resource="CPU"))


def snap(target: int, running: int, short_since: float | None = None) -> PoolSnapshot:
    return PoolSnapshot(target, running, short_since)


def test_fallback_fills_spot_that_cannot_be_placed_and_is_given_back() -> None:
    pools = [SPOT, BASE]

    def base(spot: PoolSnapshot | None, base_target: int, now: float = 100.0) -> int:
        snaps = {"base": snap(base_target, base_target)}
        if spot is not None:
            snaps["spot"] = spot
        return decide(pools, snaps, now, spot_pending_s=10.0)["base"]

    assert base(None, 1) == 1  # spot not seen yet: starting, no fallback
    assert base(snap(3, 3), 1) == 1  # spot all running
    assert base(snap(3, 0, short_since=95.0), 1) == 1  # restarting for 5 s: starting
    # Unplaceable for 10 s or more: on-demand fills the gap below spot's target (2),
    # not its overprovision.
    assert base(snap(3, 0, short_since=90.0), 1) == 3
    assert base(snap(3, 1, short_since=90.0), 1) == 2
    # max_fallback caps it: 2 more at most.
    wide = PoolConfig(name="spot", capacity="spot", replicas=5)
    assert decide([wide, BASE], {"spot": snap(5, 0, 0.0)}, 100.0, 10.0)["base"] == 3
    # One spot replica running again: one fallback replica is enough.
    assert base(snap(3, 1, short_since=90.0), 3) == 2
    # Spot restarting, not running yet: the fallback stays until it runs (hysteresis).
    assert base(snap(3, 0, short_since=99.0), 3) == 3
    # Spot running at its target again: the fallback is given back.
    assert base(snap(3, 2, short_since=90.0), 3) == 1
    assert base(snap(3, 3), 3) == 1


def fake_ctx(deployment: str, target: int, running: int) -> Any:
    return SimpleNamespace(
        app_name="app",
        deployment_name=deployment,
        target_num_replicas=target,
        running_replicas=[f"r{i}" for i in range(running)],
    )


def test_the_policies_share_what_serve_runs() -> None:
    kwargs = {
        "pools": [SPOT.model_dump(), BASE.model_dump()],
        "deployments": {"spot": "d-spot", "base": "d-base"},
        "spot_pending_s": 0.0,
    }
    spot, base = PoolPolicy(pool="spot", **kwargs), PoolPolicy(pool="base", **kwargs)
    try:
        assert spot(fake_ctx("d-spot", 3, 3)) == (3, {})
        assert base(fake_ctx("d-base", 1, 1)) == (1, {})
        # The spot node is gone: Serve runs none of spot's replicas.
        assert spot(fake_ctx("d-spot", 3, 0)) == (3, {})  # spot keeps asking for its 3
        assert pool_state.SNAPSHOTS[("app", "d-spot")].short_since is not None
        assert base(fake_ctx("d-base", 1, 1)) == (3, {})
        assert base(fake_ctx("d-base", 3, 3)) == (3, {})
        assert spot(fake_ctx("d-spot", 3, 3)) == (3, {})  # a spot node is back
        assert pool_state.SNAPSHOTS[("app", "d-spot")].short_since is None
        assert base(fake_ctx("d-base", 3, 3)) == (1, {})
    finally:
        pool_state.SNAPSHOTS.pop(("app", "d-spot"), None)
        pool_state.SNAPSHOTS.pop(("app", "d-base"), None)
    with pytest.raises(ValueError, match="pool 'nope'"):
        PoolPolicy(pool="nope", **kwargs)


def test_calls_go_to_spot_with_room_then_to_the_least_loaded() -> None:
    def rooms(spot: list[int], base: list[int]) -> list[ReplicaRoom]:
        return [ReplicaRoom("s", "spot", n) for n in spot] + [
            ReplicaRoom("b", "on_demand", n) for n in base
        ]

    assert choose_deployment(rooms([3, 1], [0]), 4, spot_only=False) == "s"
    assert choose_deployment(rooms([4, 5], [2]), 4, spot_only=False) == "b"  # spot full
    assert choose_deployment(rooms([4, 5], [6]), 4, spot_only=False) == "s"
    assert choose_deployment(rooms([], [2]), 4, spot_only=False) == "b"
    assert choose_deployment(rooms([4, 5], [0]), 4, spot_only=True) == "s"  # pinned
    assert choose_deployment(rooms([], [0]), 4, spot_only=True) is None
    assert choose_deployment([], 4, spot_only=False) is None


class PoolRouter:
    """What the client asks of a pool deployment's FleetRequestRouter."""

    def __init__(self, replicas: list[int]) -> None:
        self.replicas = replicas  # indices Serve lists
        self.placed: dict[str, int] = {}
        self.curr_replicas: dict[str, Any] = {}

    def placement(self, request_id: str) -> int | None:
        return self.placed.get(request_id)

    def outstanding(self, avoid: frozenset[int]) -> list[int]:
        return [0 for i in self.replicas if i not in avoid]

    def has_replica_outside(self, avoid: frozenset[int]) -> bool:
        return any(i not in avoid for i in self.replicas)


class PoolHandle:
    """A pool deployment's handle: each call goes to its router's first replica; the
    calls made while `fail` is set lose their replica after `fail_after` outputs."""

    def __init__(self, name: str, router: PoolRouter, fail: Any = None) -> None:
        self.deployment_name, self.router, self.fail = name, router, fail
        self.calls: list[dict[str, Any]] = []
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, **_: Any) -> PoolHandle:
        return self

    def _remote(self, **kw: Any) -> ScriptedGen:
        self.calls.append(kw)
        self.router.placed[kw["request_id"]] = self.router.replicas[0]
        resume = kw["resume"]
        start = 0 if resume is None else len(resume.outputs[0].token_ids)
        return ScriptedGen(kw["request_id"], start, self.fail, 2)


@pytest.fixture
def pools() -> Iterator[dict[str, PoolHandle]]:
    handles = {
        "spot": PoolHandle("model-chat--spot", PoolRouter([0]), fail=ActorDiedError()),
        "base": PoolHandle("model-chat--base", PoolRouter([0])),
    }
    for h in handles.values():
        router_state.ROUTERS[h.deployment_name] = h.router
    yield handles
    for h in handles.values():
        router_state.ROUTERS.pop(h.deployment_name, None)
        router_state.LISTENERS.pop(h.deployment_name, None)


async def read(c: RayGenerateClient, class_name: str | None = None) -> list[Any]:
    (stream,) = await c.admit(
        "req",
        ["hello"],
        lambda: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        class_name=class_name,
    )
    return [out async for out in stream]


def test_a_request_lost_on_spot_resumes_on_demand(
    tiny_llama: str, pools: dict[str, PoolHandle]
) -> None:
    cfg = parse_fleet_config(pools_fleet(tiny_llama))
    c = RayGenerateClient(cfg.models[0], cfg, None, 4, pools=pools)  # type: ignore[arg-type]
    spot, base = pools["spot"], pools["base"]

    async def lose_the_spot_node() -> list[Any]:
        await c.start()
        original = spot._remote

        def remote_then_node_gone(**kw: Any) -> ScriptedGen:
            gen = original(**kw)
            spot.router.replicas = []  # its node went with it: Serve lists none
            return gen

        spot.generate = SimpleNamespace(remote=remote_then_node_gone)
        return await read(c)

    got = asyncio.run(lose_the_spot_node())
    # Every token once, in order (deltas of one token each).
    assert [t for o in got for t in o.outputs[0].token_ids] == [100 + t for t in range(MAX_TOKENS)]
    assert got[-1] == output("req-0", MAX_TOKENS)
    assert len(spot.calls) == 1 and len(base.calls) == 1  # spot first, then on-demand
    moved = base.calls[0]
    # The whole answer its reader had; base's replica 0 is not spot's.
    assert moved["resume"] == fold(got[:2]) and moved["avoid"] == []
    assert c.num_in_flight_streams == 0
    assert c.card()["replicas"] == 0  # the fake routers keep no curr_replicas


def test_pool_choice_reads_the_routers_and_falls_back_by_class(
    pools: dict[str, PoolHandle],
) -> None:
    spot, base = (
        PoolRoute(p, c, f"model-chat--{p}") for p, c in (("spot", "spot"), ("base", "on_demand"))
    )
    choice = PoolChoice([base, spot], 4, frozenset({"batch"}))
    lost: dict[str, frozenset[int]] = {}

    def avoid(deployment: str) -> frozenset[int]:
        return lost.get(deployment, frozenset())

    assert choice.pick("interactive", avoid) == spot.deployment  # spot has room
    lost[spot.deployment] = frozenset({0})  # lost on spot's one replica
    assert choice.pick("interactive", avoid) == base.deployment
    assert choice.pick("batch", avoid) is None  # pinned to spot: nowhere to go now
    assert (choice.fallback("batch"), choice.fallback("interactive")) == (
        spot.deployment,
        base.deployment,
    )
    # One deployment: taken while its router is unknown or lists a replica not avoided.
    single = PoolChoice([PoolRoute("default", "on_demand", "model-solo")], 4, frozenset())
    assert single.pick("interactive", avoid) == "model-solo"
    router_state.ROUTERS["model-solo"] = PoolRouter([1])
    try:
        assert single.pick("interactive", lambda d: frozenset({1})) is None
        assert single.pick("interactive", avoid) == "model-solo"
    finally:
        del router_state.ROUTERS["model-solo"]


def test_a_spot_pinned_class_stays_on_spot(tiny_llama: str, pools: dict[str, PoolHandle]) -> None:
    cfg = parse_fleet_config(pools_fleet(tiny_llama))
    spot, base = pools["spot"], pools["base"]
    spot.fail = None
    spot.router.outstanding = lambda avoid: [9]  # type: ignore[method-assign]  # full
    c = RayGenerateClient(cfg.models[0], cfg, None, 4, pools=pools)  # type: ignore[arg-type]
    got = asyncio.run(read(c, "batch"))
    assert got[-1] == output("req-0", MAX_TOKENS)
    assert len(spot.calls) == 1 and base.calls == []
    got = asyncio.run(read(c, "interactive"))  # spot full: on-demand takes it
    assert got[-1] == output("req-0", MAX_TOKENS) and len(base.calls) == 1
