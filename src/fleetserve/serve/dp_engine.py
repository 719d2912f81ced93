"""DataParallelEngine: K engine replicas behind one API frontend (`--data-parallel-size K`).

Each replica is an AsyncEngine with its own EngineCore process (itself TP/PP when asked),
all built from the same EngineArgs. This class offers the API server the part of
AsyncEngine's surface it uses (start, shutdown, add_request, abort_all, readiness), so
the handlers do not know how many replicas there are. A request is tokenized once here,
the Router picks a replica (health, stragglers, then the `--routing` policy), and the
request goes to that replica's engine as token ids. A replica whose process dies is
unhealthy from then on and gets no new requests (its in-flight ones fail with
EngineDeadError); the server stays ready while any replica is healthy.

With `--data-parallel-size 1` the server uses a plain AsyncEngine and none of this.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
)
from fleetserve.engine.llm_engine import PromptRules, PromptType
from fleetserve.metrics import ServerMetrics
from fleetserve.serve.base import RouteRequest
from fleetserve.serve.policies import make_policy
from fleetserve.serve.replica import ReplicaHandle, ReplicaStream
from fleetserve.serve.replica_metrics import ReplicaCollector
from fleetserve.serve.router import NoHealthyReplicaError, Router


class DataParallelEngine:
    def __init__(
        self,
        args: EngineArgs,
        num_replicas: int,
        routing: str = "least_loaded",
        max_waiting_requests: int = 256,
        metrics: ServerMetrics | None = None,
        *,
        imbalance_tokens: int = 2048,
        straggler_factor: float = 2.0,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        # The thread budget (given, or every CPU) is split between the replicas, as the
        # multiproc executor splits a replica's between its ranks.
        total_threads = args.num_threads or os.cpu_count() or 1
        replica_args = replace(args, num_threads=max(1, total_threads // num_replicas))
        self.replicas = [
            ReplicaHandle(i, AsyncEngine(replica_args, max_waiting_requests, None, i))
            for i in range(num_replicas)
        ]
        first = self.replicas[0].engine
        self.args = args
        self.config, self.source = first.config, first.source
        self.tokenizer = first.tokenizer
        self._rules = PromptRules(self.tokenizer, self.config)
        policy = make_policy(
            routing,
            block_size=self.config.cache.block_size,
            seed=args.seed,
            imbalance_tokens=imbalance_tokens,
        )
        self.router: Router[ReplicaHandle] = Router(
            self.replicas,
            policy,
            overload_requests=self.config.scheduler.max_num_seqs,
            straggler_factor=straggler_factor,
        )
        self._started = False
        self._metrics: ServerMetrics | None = None
        self.metrics = metrics
        for r in self.replicas:
            r.on_stats = self._publish_stats

    # ------------------------------------------------------------- properties
    @property
    def metrics(self) -> ServerMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: ServerMetrics | None) -> None:
        """Replicas feed the shared counters; the collector adds the per-replica series."""
        assert self._metrics is None, "metrics are set once"
        self._metrics = metrics
        if metrics is None:
            return
        for r in self.replicas:
            r.engine.metrics = metrics
        metrics.registry.register(ReplicaCollector(metrics.model_name, self.replicas, self.router))

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def is_ready(self) -> bool:
        return self._started and any(r.healthy for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        """None while any replica is alive; else why each one is down."""
        reasons = [r.engine.dead_reason for r in self.replicas]
        if any(reason is None for reason in reasons):
            return None
        return "; ".join(f"replica {i}: {reason}" for i, reason in enumerate(reasons))

    @property
    def crashed(self) -> bool:
        return any(r.engine.crashed for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.engine.num_in_flight for r in self.replicas)

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> None:
        """Starts every replica's core process in parallel; any failure fails the start."""
        results = await asyncio.gather(
            *(r.engine.start(timeout_s) for r in self.replicas), return_exceptions=True
        )
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                raise RuntimeError(f"data-parallel replica {i}: {res}") from res
        self._started = True

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(r.engine.shutdown(timeout_s) for r in self.replicas))

    def abort_all(self, reason: str) -> None:
        for r in self.replicas:
            r.engine.abort_all(reason)

    # -------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
    ) -> ReplicaStream:
        """Routes and submits; raises what AsyncEngine.add_request raises. A replica whose
        queue is full is skipped for the next choice; only when all are full (or dead)
        does the request fail."""
        if not self._started:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            raise EngineNotReadyError("the model is still loading")
        text, ids = self._rules.tokenize_prompt(prompt)
        max_new = params.max_tokens
        if max_new is None:
            max_new = max(self.max_model_len - len(ids), 0)
        route = RouteRequest(request_id, tuple(ids), max_new * params.n, priority)
        routed_prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if text is not None:
            routed_prompt["prompt"] = text
        refused: dict[int, Exception] = {}
        while True:
            try:
                replica = self.router.choose(route, exclude=refused)
            except NoHealthyReplicaError:
                break
            try:
                return replica.submit(request_id, routed_prompt, params, priority, len(ids))
            except (EngineOverloadedError, EngineDeadError, EngineNotReadyError) as e:
                refused[replica.index] = e
        if any(isinstance(e, EngineOverloadedError) for e in refused.values()):
            raise EngineOverloadedError("every replica's queue is full; try again later")
        raise EngineDeadError(self.dead_reason or "no replica can take the request")

    def _publish_stats(self, replica: ReplicaHandle) -> None:
        """The model-level gauges sum (or pool) the healthy replicas' latest stats."""
        if self._metrics is None:
            return
        live = [r.stats for r in self.replicas if r.healthy and r.stats]
        if not live:
            return
        queries = sum(s.get("prefix_cache_queries", 0.0) for s in live)
        hits = sum(s.get("prefix_cache_hits", 0.0) for s in live)
        self._metrics.set_engine_stats(
            {
                "num_requests_running": sum(s.get("num_requests_running", 0.0) for s in live),
                "num_requests_waiting": sum(s.get("num_requests_waiting", 0.0) for s in live),
                "kv_cache_usage_perc": sum(s.get("kv_cache_usage_perc", 0.0) for s in live)
                / len(live),
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                **_spec_decode_totals(live),
            }
        )


def _spec_decode_totals(live: list[dict[str, float]]) -> dict[str, float]:
    """Speculative decoding totals and ratios over the replicas (none when it is off)."""
    if not any("spec_decode_num_drafts" in s for s in live):
        return {}
    keys = (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    )
    n, drafts, accepted = (sum(s.get(k, 0.0) for s in live) for k in keys)
    return {
        **dict(zip(keys, (n, drafts, accepted), strict=True)),
        "spec_decode_acceptance_rate": accepted / drafts if drafts else 0.0,
        "spec_decode_mean_accepted_length": 1 + accepted / n if n else 0.0,
    }
