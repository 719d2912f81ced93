"""fleetserve's routing policies inside Ray Serve: a `RequestRouter` for the generate
deployments (`request_router_config`), so that prefix affinity, least-loaded and the rest
pick among Serve's replicas, on any node, the way they pick among local engine processes.

Serve runs one router per deployment handle, in the process that holds the handle: here,
the ingress replica. The load figures the policies read (`ReplicaLoad`) are kept by this
router from what it routes (a request's prompt and max tokens count against its replica
from `on_request_routed` until `on_request_completed`), as the local server's LocalReplica
keeps them; the step latency comes from the replica's own `record_routing_stats`. Each
Serve replica gets a stable small index on first sight (policies and metrics use ints).

The policy's pick is the first rank; the other replicas follow, least loaded first, as the
fallback ranks Serve tries when the pick is at its `max_ongoing_requests`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from fleetserve.ray import router_state
from fleetserve.serve.base import RouteRequest, RoutingPolicy, load_key
from fleetserve.serve.policies import make_policy


@dataclass
class ReplicaLoadView:
    """One Serve replica as a fleetserve policy sees it (`serve.base.ReplicaLoad`)."""

    index: int
    replica: RunningReplica
    num_outstanding_requests: int = 0
    num_outstanding_tokens: int = 0
    healthy: bool = True

    @property
    def step_latency_s(self) -> float | None:
        value = (self.replica.routing_stats or {}).get("step_latency_s")
        return float(value) if isinstance(value, (int, float)) else None


def route_of(pending: PendingRequest | None) -> RouteRequest | None:
    """What a policy knows of a generate request: from the keyword arguments the ingress
    passes to the deployment's `generate` (None for anything else, e.g. a health probe)."""
    if pending is None:
        return None
    kw = pending.kwargs
    prompt = kw.get("prompt")
    if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
        return None
    return RouteRequest(
        str(kw.get("request_id", "")),
        tuple(prompt["prompt_token_ids"]),
        int(kw.get("num_new_tokens", 0)),
        int(kw.get("priority", 0)),
    )


class FleetRequestRouter(RequestRouter):
    """`request_router_kwargs`: policy (a POLICY_NAMES name), block_size, seed,
    imbalance_tokens, as for the local server's routers."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy: RoutingPolicy = make_policy(
            str(kwargs.get("policy", "least_loaded")),
            block_size=int(kwargs.get("block_size", 16)),
            seed=int(kwargs.get("seed", 0)),
            imbalance_tokens=int(kwargs.get("imbalance_tokens", 2048)),
        )
        self._views: dict[ReplicaID, ReplicaLoadView] = {}
        self._next_index = itertools.count()
        # internal_request_id -> (replica, tokens counted against it) per call: the calls
        # one HTTP request makes (a completion of several prompts) share its id.
        self._routed: dict[str, list[tuple[ReplicaID, int]]] = {}
        router_state.ROUTERS[self._deployment_id.name] = self

    def _view(self, replica: RunningReplica) -> ReplicaLoadView:
        view = self._views.get(replica.replica_id)
        if view is None:
            view = ReplicaLoadView(next(self._next_index), replica)
            self._views[replica.replica_id] = view
        view.replica = replica
        return view

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for replica_id in [rid for rid in self._views if rid not in live]:
            del self._views[replica_id]
        router_state.replicas_changed(self._deployment_id.name)

    def index_of(self, replica_id: ReplicaID) -> int | None:
        view = self._views.get(replica_id)
        return None if view is None else view.index

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        views = sorted((self._view(r) for r in candidate_replicas), key=lambda v: v.index)
        route = route_of(pending_request)
        if route is None:
            return [[v.replica for v in sorted(views, key=load_key)]]
        chosen = self.policy.choose(route, views)
        rest = sorted((v for v in views if v is not chosen), key=load_key)
        return [[chosen.replica], [v.replica for v in rest]] if rest else [[chosen.replica]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        route = route_of(pending_request)
        view = self._views.get(replica_id)
        if route is None or view is None:
            return
        view.num_outstanding_requests += 1
        view.num_outstanding_tokens += route.num_tokens
        calls = self._routed.setdefault(pending_request.metadata.internal_request_id, [])
        calls.append((replica_id, route.num_tokens))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        calls = self._routed.get(internal_request_id, [])
        match = next((c for c in calls if c[0] == replica_id), None)
        if match is None:
            return
        calls.remove(match)
        if not calls:
            del self._routed[internal_request_id]
        view = self._views.get(replica_id)
        if view is not None:
            view.num_outstanding_requests -= 1
            view.num_outstanding_tokens -= match[1]

    def loads(self) -> Sequence[ReplicaLoadView]:
        """The replicas' figures as this router sees them (for the ingress's metrics)."""
        return sorted(self._views.values(), key=lambda v: v.index)
