"""fleetserve's routing policies inside Ray Serve: a `RequestRouter` for the generate
deployments (`request_router_config`), so that prefix affinity, least-loaded and the rest
pick among Serve's replicas, on any node, the way they pick among local engine processes.

Serve runs one router per deployment handle, in the process that holds the handle: here,
the ingress replica. The load figures the policies read (`ReplicaLoad`) are kept by this
router from what it routes (a request's prompt and max tokens count against its replica
from `on_request_routed` until `on_request_completed`), as the local server's LocalReplica
keeps them; the step latency comes from the replica's own `record_routing_stats`. Each
Serve replica gets a stable small index on first sight (policies and metrics use ints).
A request counts against the replica the policy picks from the moment it is picked (a
reservation, moved if Serve sends the call elsewhere, dropped if it never sends it), not
only from `on_request_routed`: a burst chosen before Serve reports the first routes would
otherwise all see the same loads and go to one replica.

The policy's pick is the first rank; the other replicas follow, least loaded first, as the
fallback ranks Serve tries when the pick is at its `max_ongoing_requests`.

Request migration (ingress side in clients.py): the router remembers which replica each
engine request was last routed to (`placement`), so that the ingress knows which replica
a lost stream was on, and a resubmitted request names the replicas it lost in its `avoid`
argument, which the router never picks for it (if only those are left it picks none, and
Serve tries again after a backoff, until a new replica is up).
"""

from __future__ import annotations

import itertools
import time
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
from fleetserve.serve.contracts import RouteRequest, RoutingPolicy, load_key
from fleetserve.serve.routing.adapters import adapter_candidates
from fleetserve.serve.routing.policies import make_policy

# Engine requests whose replica the router remembers (the newest; a request is looked up
# only while it streams, so an old entry is never needed).
_PLACEMENTS_KEPT = 10_000
# A pick Serve never routed (the caller left, the call failed before it was sent) stops
# counting against its replica after this long.
_RESERVATION_S = 10.0


@dataclass
class ReplicaLoadView:
    """One Serve replica as a fleetserve policy sees it (`serve.base.ReplicaLoad`)."""

    index: int
    replica: RunningReplica
    num_outstanding_requests: int = 0
    num_outstanding_tokens: int = 0
    healthy: bool = True
    # Adapters of requests routed here that its stats did not list yet.
    routed_loras: frozenset[str] = frozenset()

    @property
    def step_latency_s(self) -> float | None:
        value = (self.replica.routing_stats or {}).get("step_latency_s")
        return float(value) if isinstance(value, (int, float)) else None

    @property
    def lora_names(self) -> frozenset[str]:
        """The adapters it holds (serve/routing/adapters.py): those its engine reported in
        its last routing stats (loaded or in its CPU cache) and those this router sent
        there since (being loaded for that request)."""
        stats = self.replica.routing_stats or {}
        reported = frozenset(str(n) for n in stats.get("lora_adapters") or ())
        self.routed_loras -= reported
        return reported | self.routed_loras

    @property
    def draining(self) -> bool:
        """The replica said (in its last routing stats) that it takes nothing new: drained
        after a notice, or hung (ray/health.py)."""
        return bool((self.replica.routing_stats or {}).get("draining", False))


def route_of(pending: PendingRequest | None) -> RouteRequest | None:
    """What a policy knows of a generate request: from the keyword arguments the ingress
    passes to the deployment's `generate` (None for anything else, e.g. a health probe)."""
    if pending is None:
        return None
    kw = pending.kwargs
    prompt = kw.get("prompt")
    if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
        return None
    ids = tuple(prompt["prompt_token_ids"])
    resume = kw.get("resume")
    if resume is not None:  # a migrated request prefills its tokens so far too
        ids += tuple(t for c in resume.outputs for t in c.token_ids)
    lora = kw.get("lora")
    return RouteRequest(
        str(kw.get("request_id", "")),
        ids,
        int(kw.get("num_new_tokens", 0)),
        int(kw.get("priority", 0)),
        None if lora is None else str(lora.lora_name),
    )


def avoided(pending: PendingRequest | None) -> frozenset[int]:
    """The replica indices a resubmitted request must not go to (those it was lost on)."""
    if pending is None:
        return frozenset()
    return frozenset(int(i) for i in pending.kwargs.get("avoid") or ())


class FleetRequestRouter(RequestRouter):
    """`request_router_kwargs`: policy (a POLICY_NAMES name), block_size, seed,
    imbalance_tokens, as for the local server's routers."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.imbalance_tokens = int(kwargs.get("imbalance_tokens", 2048))
        self.policy: RoutingPolicy = make_policy(
            str(kwargs.get("policy", "least_loaded")),
            block_size=int(kwargs.get("block_size", 16)),
            seed=int(kwargs.get("seed", 0)),
            imbalance_tokens=self.imbalance_tokens,
        )
        self._views: dict[ReplicaID, ReplicaLoadView] = {}
        self._next_index = itertools.count()
        # internal_request_id -> (replica, tokens counted against it) per call: the calls
        # one HTTP request makes (a completion of several prompts) share its id.
        self._routed: dict[str, list[tuple[ReplicaID, int]]] = {}
        # engine request id -> index of the replica it was last routed to. Written on the
        # router's thread, read (`placement`) on the ingress's: single dict operations.
        self._placed: dict[str, int] = {}
        # engine request id -> (replica picked, tokens counted, time.monotonic()) until
        # Serve says where the call went (on_request_routed).
        self._reserved: dict[str, tuple[ReplicaID, int, float]] = {}
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
        avoid = avoided(pending_request)
        views = sorted(
            (v for v in map(self._view, candidate_replicas) if v.index not in avoid),
            key=lambda v: v.index,
        )
        if not views:
            return []  # only replicas the request was lost on: Serve retries soon
        # A draining replica would only refuse the call (it then moves, costing one of its
        # migrations); it is picked only while no other is listed.
        views = [v for v in views if not v.draining] or views
        route = route_of(pending_request)
        if route is None:
            return [[v.replica for v in sorted(views, key=load_key)]]
        # A LoRA request prefers the replicas holding its adapter, within the load bound.
        cands = adapter_candidates(route, views, self.imbalance_tokens)
        chosen = self.policy.choose(route, cands)
        if route.lora_name is not None:
            chosen.routed_loras |= {route.lora_name}
        self._reserve(route, chosen)
        rest = sorted((v for v in views if v is not chosen), key=load_key)
        return [[chosen.replica], [v.replica for v in rest]] if rest else [[chosen.replica]]

    def _count(self, replica_id: ReplicaID, num_requests: int, num_tokens: int) -> None:
        view = self._views.get(replica_id)
        if view is not None:
            view.num_outstanding_requests += num_requests
            view.num_outstanding_tokens += num_tokens

    def _unreserve(self, req_id: str) -> None:
        held = self._reserved.pop(req_id, None)
        if held is not None:
            self._count(held[0], -1, -held[1])

    def _reserve(self, route: RouteRequest, chosen: ReplicaLoadView) -> None:
        """Count the request against its pick now (a retry of the same call replaces its
        earlier pick); picks never routed expire."""
        now = time.monotonic()
        for req_id in [k for k, v in self._reserved.items() if now - v[2] > _RESERVATION_S]:
            self._unreserve(req_id)
        self._unreserve(route.req_id)
        replica_id = chosen.replica.replica_id
        self._reserved[route.req_id] = (replica_id, route.num_tokens, now)
        self._count(replica_id, 1, route.num_tokens)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        route = route_of(pending_request)
        if route is not None:
            self._unreserve(route.req_id)  # counted below where it actually went
        view = self._views.get(replica_id)
        if route is None or view is None:
            return
        view.num_outstanding_requests += 1
        view.num_outstanding_tokens += route.num_tokens
        self._placed.pop(route.req_id, None)  # (re)inserted as the newest
        self._placed[route.req_id] = view.index
        if len(self._placed) > _PLACEMENTS_KEPT:
            del self._placed[next(iter(self._placed))]
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

    def placement(self, request_id: str) -> int | None:
        """The index of the replica the engine request was last routed to; None if it
        has not been routed (yet)."""
        return self._placed.get(request_id)

    def has_replica_outside(self, avoid: frozenset[int]) -> bool:
        """Whether Serve lists a replica that is not one of `avoid` (one not routed to yet
        has no index, so it counts)."""
        replica_ids = list(self.curr_replicas)  # copied at once: Serve's thread changes it
        return any(self.index_of(rid) not in avoid for rid in replica_ids)

    def outstanding(self, avoid: frozenset[int]) -> list[int]:
        """Requests routed to each replica Serve lists, those in `avoid` left out (0 for
        one not routed to yet: it has no index, so it is never avoided)."""
        out = []
        for replica_id in list(self.curr_replicas):  # copied at once (Serve's thread)
            view = self._views.get(replica_id)
            if view is None:
                out.append(0)
            elif view.index not in avoid:
                out.append(view.num_outstanding_requests)
        return out

    def loads(self) -> Sequence[ReplicaLoadView]:
        """The replicas' figures as this router sees them (for the ingress's metrics)."""
        return sorted(self._views.values(), key=lambda v: v.index)
