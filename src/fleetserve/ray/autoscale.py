"""Autoscaling a model deployment on queue depth (Serve's custom autoscaling policy).

Serve's default policy divides requests in flight by `target_ongoing_requests`; for an LLM
that is the wrong signal: a replica runs a batch (`max_num_seqs`) at once and what says
it is short is work *waiting* (the engine's scheduler queue, requests Serve has not placed
yet) and a KV cache too full to admit more. Each replica reports, every metrics interval,
`num_running` and `num_waiting` (deployments.py); this policy sizes the deployment so that
every replica holds at most its seats plus `target_queue_depth` waiting requests:

    desired = ceil((running + waiting + queued at handles) / (seats + target_queue_depth))

and one more replica while requests wait and the replicas' KV caches are nearly full.
Serve then applies min/max replicas and the up/downscale delays; 0 replicas with a request
queued at a handle scales to one at once (Serve's cold-start path), so the first request
after a scale to zero waits for a replica instead of failing.
"""

from __future__ import annotations

import math
from typing import Any

from ray.serve.config import AutoscalingContext

# Above this mean KV use, waiting requests are waiting for blocks, not for seats.
KV_FULL = 0.9


class QueueDepthPolicy:
    def __init__(self, seats_per_replica: int, target_queue_depth: float) -> None:
        if seats_per_replica < 1:
            raise ValueError(f"seats_per_replica must be >= 1, got {seats_per_replica}")
        if not target_queue_depth > 0:
            raise ValueError(f"target_queue_depth must be > 0, got {target_queue_depth}")
        self.seats_per_replica = seats_per_replica
        self.target_queue_depth = target_queue_depth

    def desired(self, current: int, running: float, waiting: float, kv_usage: float | None) -> int:
        """The replica count for these figures (before Serve's bounds and delays)."""
        per_replica = self.seats_per_replica + self.target_queue_depth
        want = math.ceil((running + waiting) / per_replica - 1e-9)
        if waiting > 0 and kv_usage is not None and kv_usage >= KV_FULL:
            want = max(want, current + 1)
        return max(want, 0)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}

        def total(name: str) -> float:
            return float(sum(metrics.get(name, {}).values()))

        kv = metrics.get("kv_cache_usage", {})
        kv_usage = sum(kv.values()) / len(kv) if kv else None
        queued = float(ctx.total_queued_requests or 0.0)  # at handles: no replica had room
        want = self.desired(
            ctx.current_num_replicas, total("num_running"), total("num_waiting") + queued, kv_usage
        )
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return min(max(want, low), high), {}
