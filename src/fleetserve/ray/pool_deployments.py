"""A generate model's spot and on-demand `pools:` on Ray Serve.

Each pool is a Serve deployment of its own (`model-<model>--<pool>`), whose replicas ask
for a little of a custom resource (`placement.spot_resource`, default "spot", or
`placement.on_demand_resource`, default "on_demand"), or select node labels
(`placement.spot_labels` / `on_demand_labels`), so that Ray places them only on the
nodes of their kind. Serve keeps each deployment at its replica count: it replaces a
replica that dies, and a replica whose node was preempted waits (PENDING_ALLOCATION) until
a node with the resource joins.

The counts are set by `PoolPolicy`, the deployments' Serve autoscaling policy, which runs
in Serve's controller: a spot pool holds `replicas + overprovision`; an on-demand pool
holds its `replicas` (the base), plus fallback replicas while spot is short, as
serve/replicas/pool_plan.py's `plan()` decides (the local server's rule, with the same hysteresis).
Spot replicas that Serve has not had running for `placement.spot_pending_s` count as
spot that could not be provisioned (the local PoolController's CapacityUnavailableError);
ones missing for less count as starting (a replica Serve is restarting). Once spot runs
at its target again, the fallback is given back: Serve stops those replicas, and the
requests they hold move to others (request migration).

The ingress (clients.py) sends each call to the spot deployment while one of its
replicas has room (`prefer_spot`), otherwise to the least loaded replica of any pool; a
class with `capacity: spot` only to spot. A request lost with its replica resumes on any
pool's replica (the replicas it was lost on excepted).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.config import AutoscalingContext

from fleetserve.ray import router_state
from fleetserve.serve.config.fleet_config import ModelEntry, PlacementConfig, PoolConfig
from fleetserve.serve.replicas.pool_plan import (
    MemberView,
    Start,
    Stop,
    plan,
    pool_size,
    prefer_spot,
)

# How much of its pool's custom resource one replica asks for: a sliver, so that the
# node's CPUs and memory, not the label, bound how many replicas it runs.
RESOURCE_PER_REPLICA = 0.001


def deployment_name(model: str, pool: str | None = None) -> str:
    """The Serve deployment of a model (or of one of its pools)."""
    name = "model-" + model if pool is None else f"model-{model}--{pool}"
    return name.replace("#", "_")  # '#' is Serve's separator in replica ids


def served_pools(entry: ModelEntry) -> list[PoolConfig]:
    """The model's pools that get a deployment (one that may never run a replica has
    none: Serve needs max_replicas >= 1, and routing to it would wait forever)."""
    return [p for p in entry.pools or [] if pool_size(p)[1] > 0]


def capacity_placement(place: PlacementConfig, spot: bool) -> dict[str, Any]:
    """The Ray actor options that put a replica on spot (or on-demand) nodes: a label
    selector where the placement gives labels for it, else a sliver of its resource."""
    labels = place.spot_labels if spot else place.on_demand_labels
    if labels is not None:
        return {"label_selector": dict(labels)}
    return {
        "resources": {
            place.spot_resource if spot else place.on_demand_resource: RESOURCE_PER_REPLICA
        }
    }


def pool_options(
    entry: ModelEntry, pool: PoolConfig, model_opts: Mapping[str, Any], stats_period_s: float
) -> dict[str, Any]:
    """The Serve deployment options of one pool: the model's (`model_opts`, without a
    replica count) with the pool's resource and its PoolPolicy."""
    place = entry.placement or PlacementConfig()
    actor = dict(model_opts["ray_actor_options"])
    where = capacity_placement(place, pool.is_spot)
    if "resources" in where:
        actor["resources"] = {**actor.get("resources", {}), **where["resources"]}
    else:
        actor.update(where)
    low, high = pool_size(pool)
    opts = {k: v for k, v in model_opts.items() if k not in ("num_replicas", "autoscaling_config")}
    opts["name"] = deployment_name(entry.name, pool.name)
    opts["ray_actor_options"] = actor
    opts["autoscaling_config"] = {
        "min_replicas": low,
        "initial_replicas": low,
        "max_replicas": high,
        # The policy's own rule holds the counts steady (hysteresis, spot_pending_s).
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "metrics_interval_s": stats_period_s,
        "look_back_period_s": 2 * stats_period_s,
        "policy": {
            "policy_function": PoolPolicy,
            "policy_kwargs": {
                "pools": [p.model_dump() for p in served_pools(entry)],
                "pool": pool.name,
                "deployments": {
                    p.name: deployment_name(entry.name, p.name) for p in served_pools(entry)
                },
                "spot_pending_s": place.spot_pending_s,
            },
        },
    }
    return opts


def decide(
    pools: Sequence[PoolConfig],
    snapshots: Mapping[str, Any],
    now: float,
    spot_pending_s: float,
) -> dict[str, int]:
    """Each on-demand pool's replica count, by plan(), from the pools' last snapshots
    (pool_state.PoolSnapshot by pool name; a pool not seen yet counts as starting at its
    size). Spot missing for `spot_pending_s` or more is spot that cannot be provisioned."""
    index = itertools.count()
    members: list[MemberView] = []
    available: dict[str, bool] = {}
    targets: dict[str, int] = {}

    def add(pool: PoolConfig, n: int, state: str) -> None:
        capacity = "spot" if pool.is_spot else "on_demand"
        members.extend(MemberView(next(index), pool.name, capacity, state) for _ in range(n))  # type: ignore[arg-type]

    for p in pools:
        snap = snapshots.get(p.name)
        target = pool_size(p)[0] if snap is None else snap.target
        running = 0 if snap is None else min(snap.running, target)
        if not p.is_spot:
            targets[p.name] = target
        add(p, running, "ready")
        stale = (
            p.is_spot
            and snap is not None
            and snap.short_since is not None
            and now - snap.short_since >= spot_pending_s
        )
        if stale:
            available[p.name] = False  # what Serve cannot place is not "starting"
        else:
            add(p, target - running, "starting")
    by_index = {m.index: m for m in members}
    for action in plan(pools, members, available):
        if isinstance(action, Start) and action.pool in targets:
            targets[action.pool] += 1
        elif isinstance(action, Stop) and by_index[action.index].pool in targets:
            targets[by_index[action.index].pool] -= 1
    return targets


class PoolPolicy:
    """Serve's autoscaling policy for one pool deployment (see the module's docstring).
    Every call records the deployment's figures (pool_state) for its model's other
    pools; a spot pool keeps its size, an on-demand pool takes decide()'s count."""

    def __init__(
        self,
        pools: list[dict[str, Any]],
        pool: str,
        deployments: dict[str, str],
        spot_pending_s: float,
    ) -> None:
        self.pools = [PoolConfig.model_validate(p) for p in pools]
        by_name = {p.name: p for p in self.pools}
        if pool not in by_name:
            raise ValueError(f"pool {pool!r} is not one of {sorted(by_name)}")
        self.pool = by_name[pool]
        self.deployments = deployments
        self.spot_pending_s = spot_pending_s

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        from fleetserve.ray import pool_state  # by name: shared by every policy (pool_state)

        now = time.monotonic()
        app = ctx.app_name or ""
        key = (app, ctx.deployment_name)
        target = ctx.target_num_replicas
        running = len(ctx.running_replicas)
        last = pool_state.SNAPSHOTS.get(key)
        short_since = None
        if running < target:
            short_since = last.short_since if last and last.short_since is not None else now
        pool_state.SNAPSHOTS[key] = pool_state.PoolSnapshot(target, running, short_since)
        if self.pool.is_spot:
            return pool_size(self.pool)[0], {}
        snapshots = {
            p.name: snap
            for p in self.pools
            if (snap := pool_state.SNAPSHOTS.get((app, self.deployments[p.name]))) is not None
        }
        return decide(self.pools, snapshots, now, self.spot_pending_s)[self.pool.name], {}


@dataclass(frozen=True)
class PoolRoute:
    """One pool deployment as the ingress sends to it."""

    pool: str
    capacity: str  # "spot" | "on_demand"
    deployment: str


@dataclass(frozen=True)
class ReplicaRoom:
    """One replica of a pool deployment, as the ingress's routers see it (prefer_spot's
    CapacityLoad)."""

    deployment: str
    capacity: str
    num_outstanding_requests: int


def choose_deployment(
    replicas: Iterable[ReplicaRoom], overload_requests: int, spot_only: bool
) -> str | None:
    """The deployment a call goes to: among prefer_spot's candidates, the one holding the
    least loaded replica (Serve's router then picks the replica by the model's policy);
    None when there is no candidate (no replica known, or only avoided ones)."""
    chosen = prefer_spot(list(replicas), overload_requests, spot_only)
    if not chosen:
        return None
    return min(chosen, key=lambda r: r.num_outstanding_requests).deployment


class PoolChoice:
    """The ingress's choice among a generate model's deployments (one, or one per pool),
    read from Serve's routers in this process (router_state)."""

    def __init__(
        self,
        routes: Sequence[PoolRoute],
        overload_requests: int,
        spot_only_classes: frozenset[str],
    ) -> None:
        self.routes = list(routes)
        # prefer_spot's overload rule, as the local Router's: a full batch outstanding.
        self.overload_requests = overload_requests
        self.spot_only_classes = spot_only_classes

    def pick(self, class_name: str, avoid: Callable[[str], frozenset[int]]) -> str | None:
        """The deployment a call goes to; None while none lists a replica the request
        may go to (one not in `avoid(deployment)`: those it was lost on)."""
        if len(self.routes) == 1:
            deployment = self.routes[0].deployment
            router = router_state.ROUTERS.get(deployment)
            if router is None or router.has_replica_outside(avoid(deployment)):
                return deployment
            return None
        rooms = []
        for route in self.routes:
            router = router_state.ROUTERS.get(route.deployment)
            if router is None:
                continue
            rooms += [
                ReplicaRoom(route.deployment, route.capacity, n)
                for n in router.outstanding(avoid(route.deployment))
            ]
        spot_only = class_name in self.spot_only_classes
        return choose_deployment(rooms, self.overload_requests, spot_only)

    def fallback(self, class_name: str) -> str:
        """Where a call goes while no deployment lists a replica for it (at startup, or
        scaled to zero): Serve holds it until one is up. A spot-pinned class: the first
        spot pool; otherwise the first on-demand pool (its base runs)."""
        want = "spot" if class_name in self.spot_only_classes else "on_demand"
        return next(
            (r.deployment for r in self.routes if r.capacity == want), self.routes[0].deployment
        )
