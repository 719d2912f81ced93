"""Router: which replicas may take a request now (health, stragglers), then the policy picks.

A replica is a *straggler* when its step-latency EWMA is more than `straggler_factor`
times the median of the other measured healthy replicas' EWMAs, and more than
`straggler_min_gap_s` above it (twice a millisecond is scheduling noise). Stragglers are routed
around: they are candidates only when every other healthy replica is overloaded (has
`overload_requests` or more requests outstanding, i.e. a full batch). A straggler's
latency is only refreshed by its own steps, so one that has sat idle, ejected, for
`probe_interval_s` gets the next request as a probe; if it has recovered, it stops being
a straggler.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Sequence
from typing import Generic

from fleetserve.serve.contracts import R, RouteRequest, RoutingPolicy


class NoHealthyReplicaError(RuntimeError):
    """Every replica is dead (or refused the request)."""


class Router(Generic[R]):
    def __init__(
        self,
        replicas: Sequence[R],
        policy: RoutingPolicy,
        *,
        overload_requests: int,
        straggler_factor: float = 2.0,
        straggler_min_gap_s: float = 0.01,
        probe_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if straggler_factor <= 1.0:
            raise ValueError(f"straggler_factor must be > 1, got {straggler_factor}")
        if overload_requests < 1:
            raise ValueError(f"overload_requests must be >= 1, got {overload_requests}")
        # Not copied: a ReplicaSet adds and removes members of this very list (in index
        # order) while the router serves.
        self.replicas = replicas
        self.policy = policy
        self.overload_requests = overload_requests
        self.straggler_factor = straggler_factor
        self.straggler_min_gap_s = straggler_min_gap_s
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        # Straggler index -> when it was ejected or last probed.
        self._ejected_since: dict[int, float] = {}

    def stragglers(self) -> list[R]:
        """Healthy replicas much slower per step than the median of the other healthy ones."""
        latency: dict[int, float] = {}
        for r in self.replicas:
            if r.healthy and r.step_latency_s is not None:
                latency[r.index] = r.step_latency_s
        slow = []
        for r in self.replicas:
            others = [s for i, s in latency.items() if i != r.index]
            if r.index not in latency or not others:
                continue
            median = statistics.median(others)
            mine = latency[r.index]
            if mine > self.straggler_factor * median and mine > median + self.straggler_min_gap_s:
                slow.append(r)
        return slow

    def candidates(self, exclude: Collection[int] = ()) -> list[R]:
        """The replicas the policy may pick from now, in index order; empty if none is up."""
        healthy = [r for r in self.replicas if r.healthy and r.index not in exclude]
        slow = {r.index for r in self.stragglers()}
        now = self._clock()
        for index in list(self._ejected_since):
            if index not in slow:
                del self._ejected_since[index]  # recovered (or dead)
        fast = [r for r in healthy if r.index not in slow]
        if len(fast) == len(healthy):
            return healthy
        for r in healthy:
            if r.index not in slow:
                continue
            since = self._ejected_since.setdefault(r.index, now)
            if r.num_outstanding_requests == 0 and now - since >= self.probe_interval_s:
                self._ejected_since[r.index] = now
                return [r]
        if not fast or all(r.num_outstanding_requests >= self.overload_requests for r in fast):
            return healthy
        return fast

    def choose(
        self,
        request: RouteRequest,
        exclude: Collection[int] = (),
        narrow: Callable[[list[R]], list[R]] | None = None,
    ) -> R:
        """`narrow` picks among the candidates before the policy does (spot first)."""
        cands = self.candidates(exclude)
        if narrow is not None:
            cands = narrow(cands)
        if not cands:
            raise NoHealthyReplicaError("no healthy replica can take the request")
        return self.policy.choose(request, cands)
