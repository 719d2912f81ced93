"""GenerateService: one generate model of the fleet, behind its name.

    admit() -> tokenize + validate (400s) -> class queue (503 when full) -> dispatch when a
    replica has room for the class -> Router picks among those -> Replica.submit

A request waits in its class's queue (serve/sla.py) until some live replica has room
for it at its class's level: the replica holds fewer than a batch (`max_num_seqs`) of
sequences of that class or more important ones. Less important work never blocks more
important work, since the engine's priority scheduler preempts it; so a flood of `batch`
requests fills the queue and the batch, and an `interactive` request still goes to the
engine at once and takes a batch request's seat on the next step. A request still queued
past its class's `max_queue_time_s` is shed (503) before it costs any compute.

The service owns its queue, its ReplicaSet and its Router; everything runs on the API
process's event loop thread.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
)
from fleetserve.engine.llm_engine import PromptRules, PromptType
from fleetserve.metrics import ModelMetrics
from fleetserve.serve.admission import ClassObserver, Pending, PreparedPrompt, ShedError
from fleetserve.serve.base import Replica, ReplicaStreamLike, RouteRequest
from fleetserve.serve.policies import make_policy
from fleetserve.serve.replica import LocalReplica
from fleetserve.serve.replica_set import ReplicaSet
from fleetserve.serve.router import NoHealthyReplicaError, Router
from fleetserve.serve.sla import (
    ClassQueue,
    Entry,
    QueueFullError,
    ServiceClass,
    engine_priority,
    oversubscription,
)
from fleetserve.tokenizer import Tokenizer

# The engines' own bound on unstarted requests; the class queues bound them first.
_ENGINE_MAX_WAITING = 1 << 20


class GenerateService:
    kind = "generate"

    def __init__(
        self,
        name: str,
        args: EngineArgs,
        num_replicas: int,
        classes: Mapping[str, ServiceClass],
        default_class: str,
        *,
        routing: str = "least_loaded",
        metrics: ModelMetrics | None = None,
        imbalance_tokens: int = 2048,
        straggler_factor: float = 2.0,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {num_replicas}")
        self.name = name
        # The thread budget (given, or every CPU) is split between the replicas, as the
        # multiproc executor splits a replica's between its ranks.
        total_threads = args.num_threads or os.cpu_count() or 1
        self._replica_args = replace(args, num_threads=max(1, total_threads // num_replicas))
        self.args = args
        self.config, self.source = args.resolve()
        self.tokenizer = Tokenizer.from_source(self.source)
        self._rules = PromptRules(self.tokenizer, self.config)
        self.metrics = metrics
        self.queue: ClassQueue[Pending] = ClassQueue(classes, default_class)
        # A request's own `priority` reaches the engine only under the priority policy;
        # elsewhere a non-zero one is refused rather than ignored.
        self.priority_ordered = self.config.scheduler.policy == "priority"
        self.replica_set = ReplicaSet(self._new_replica)
        self.replica_set.on_change = self._dispatch
        for _ in range(num_replicas):
            self.replica_set.create()
        policy = make_policy(
            routing,
            block_size=self.config.cache.block_size,
            seed=args.seed,
            imbalance_tokens=imbalance_tokens,
        )
        self.router: Router[Replica] = Router(
            self.replica_set.members,
            policy,
            overload_requests=self.config.scheduler.max_num_seqs,
            straggler_factor=straggler_factor,
        )
        self._unstarted: Counter[str] = Counter()
        self._started = False
        self._expiry: asyncio.TimerHandle | None = None

    def _new_replica(self, index: int) -> Replica:
        """A replica of this model: a local engine-core process (other transports plug in
        here: a Ray actor, a remote server)."""
        engine = AsyncEngine(self._replica_args, _ENGINE_MAX_WAITING, self.metrics, index)
        replica = LocalReplica(
            index,
            engine,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            oversubscribe=oversubscription(self.queue.classes),
        )
        replica.on_stats = self._publish_stats
        return replica

    # ------------------------------------------------------------- state
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def is_ready(self) -> bool:
        return self._started and bool(self.replica_set.live)

    @property
    def dead_reason(self) -> str | None:
        """None while any replica is alive (or loading); else why each one is down."""
        reasons = [r.dead_reason for r in self.replica_set]
        if not reasons:
            return "the model has no replica"
        if any(reason is None for reason in reasons):
            return None
        return "; ".join(f"replica {r.index}: {r.dead_reason}" for r in self.replica_set)

    @property
    def crashed(self) -> bool:
        return any(r.crashed for r in self.replica_set)

    @property
    def num_in_flight(self) -> int:
        return len(self.queue) + sum(r.num_outstanding_requests for r in self.replica_set)

    def card(self) -> dict[str, Any]:
        return {
            "root": self.config.model_path,
            "max_model_len": self.max_model_len,
            "replicas": len(self.replica_set.live),
        }

    def waiting_by_class(self) -> dict[str, int]:
        return {name: self.num_waiting(name) for name in self.queue.classes}

    def num_waiting(self, class_name: str) -> int:
        """Requests of the class not started yet: queued here, or sent and not yet begun."""
        return self.queue.num_waiting(class_name) + self._unstarted[class_name]

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> None:
        await self.replica_set.start_all(timeout_s)
        self._started = True
        self._dispatch()

    async def shutdown(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._fail_queued(lambda: EngineDeadError("the server is shutting down"))
        await self.replica_set.stop_all()

    def abort_all(self, reason: str) -> None:
        self._fail_queued(lambda: EngineDeadError(reason))
        for r in self.replica_set:
            r.abort_all(reason)

    # ------------------------------------------------------------- requests
    async def admit(
        self,
        request_id: str,
        prompts: list[PromptType],
        params_for: Callable[[], SamplingParams],
        class_name: str | None = None,
        priority: int = 0,
    ) -> list[ReplicaStreamLike]:
        """Validates every prompt (ValueError naming the field), queues the request in its
        class and returns its streams once it is sent to a replica: one per prompt, all on
        their way. Raises ShedError (queue full / waited too long), EngineNotReadyError,
        EngineDeadError. Cancelling the wait takes the request out of the queue."""
        if not self._started:
            if self.dead_reason is not None and self.replica_set.members:
                raise EngineDeadError(self.dead_reason)
            raise EngineNotReadyError("the model is still loading")
        if not self.replica_set.live:
            raise EngineDeadError(self.dead_reason or "no replica of the model is serving")
        cls = self.queue.resolve(class_name)
        if priority != 0 and not self.priority_ordered:
            raise ValueError(
                f"priority is not honoured by {self.name!r}: it schedules first-come "
                "first-served; serve it with scheduling_policy priority to order by priority"
            )
        items = [self._prepare(f"{request_id}-{i}", p, params_for()) for i, p in enumerate(prompts)]
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        pending = Pending(items, loop.create_future(), arrival)
        try:
            entry = self.queue.push(pending, cls.name, priority, arrival)
        except QueueFullError as e:
            self._shed(cls.name, "queue_full")
            raise ShedError(str(e), cls.name, "overloaded") from None
        self._schedule_expiry()
        self._dispatch()
        try:
            return await pending.future
        except asyncio.CancelledError:
            self.queue.remove(entry)
            fut = pending.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                for s in fut.result():
                    s.close()
            raise

    def _prepare(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> PreparedPrompt:
        text, ids = self._rules.tokenize_prompt(prompt)
        self._rules.validate(ids, params)
        capacity = min(r.kv_capacity_tokens or 0 for r in self.replica_set.live)
        room = min(self.max_model_len, capacity) - len(ids)
        if room < 1:
            raise ValueError(f"the prompt's {len(ids)} tokens do not fit the KV cache")
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                f"the KV cache capacity of {capacity} tokens"
            )
        routed: dict[str, Any] = {"prompt_token_ids": ids}
        if text is not None:
            routed["prompt"] = text
        return PreparedPrompt(request_id, routed, params, len(ids))

    def _dispatch(self) -> None:
        """Sends queued requests, most important first, while some replica has room."""
        while (entry := self.queue.peek()) is not None:
            pending = entry.payload
            level = entry.service_class.priority
            no_room = {r.index for r in self.replica_set if not r.has_room(level, pending.num_seqs)}
            if not self.replica_set.live:
                self._fail_queued(
                    lambda: EngineDeadError(self.dead_reason or "no replica is serving")
                )
                return
            if all(r.index in no_room for r in self.replica_set.live):
                return  # the head waits for room; nothing behind it has more
            self.queue.pop()
            self._send(entry, no_room)

    def _send(self, entry: Entry[Pending], no_room: set[int]) -> None:
        pending = entry.payload
        cls = entry.service_class
        streams: list[ReplicaStreamLike] = []
        try:
            for item in pending.items:
                route = RouteRequest(
                    item.request_id,
                    tuple(item.prompt["prompt_token_ids"]),
                    (item.params.max_tokens or 0) * item.params.n,
                    entry.priority,
                )
                try:
                    replica = self.router.choose(route, exclude=no_room)
                except NoHealthyReplicaError:
                    replica = self.router.choose(route)  # later prompts of a wide request
                observer = ClassObserver(self.metrics, cls.name, pending.arrival, self._unstarted)
                try:
                    stream = replica.submit(
                        item.request_id,
                        item.prompt,
                        copy.copy(item.params),
                        engine_priority(cls, entry.priority),
                        item.num_prompt_tokens,
                        level=cls.priority,
                        observer=observer,
                    )
                except BaseException:
                    observer.on_end()  # it never started
                    raise
                streams.append(stream)
        except Exception as e:
            for s in streams:
                s.close()
            if not pending.future.done():
                pending.future.set_exception(e)
            return
        if pending.future.done():  # the client left while it was being sent
            for s in streams:
                s.close()
            return
        pending.future.set_result(streams)

    def _schedule_expiry(self) -> None:
        deadline = self.queue.next_deadline()
        if deadline == float("inf"):
            return
        loop = asyncio.get_running_loop()
        if self._expiry is not None and self._expiry.when() <= deadline:
            return
        if self._expiry is not None:
            self._expiry.cancel()
        # loop.time() is time.monotonic() on every asyncio loop of CPython.
        self._expiry = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        for entry in self.queue.expire(time.monotonic()):
            cls = entry.service_class
            self._shed(cls.name, "queue_timeout")
            if not entry.payload.future.done():
                entry.payload.future.set_exception(
                    ShedError(
                        f"the request waited {cls.max_queue_time_s:g} s in the {cls.name!r} "
                        "queue (its max_queue_time_s) without starting; try again later",
                        cls.name,
                        "queue_timeout",
                    )
                )
        self._schedule_expiry()

    def _fail_queued(self, error: Callable[[], Exception]) -> None:
        while (entry := self.queue.pop()) is not None:
            if not entry.payload.future.done():
                entry.payload.future.set_exception(error())

    def _shed(self, class_name: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.add_shed(class_name, reason)

    def _publish_stats(self, replica: Replica) -> None:
        """The model-level gauges sum (or pool) the healthy replicas' latest stats."""
        if self.metrics is None:
            return
        live = [r.stats for r in self.replica_set.live if r.stats]
        if not live:
            return
        queries = sum(s.get("prefix_cache_queries", 0.0) for s in live)
        hits = sum(s.get("prefix_cache_hits", 0.0) for s in live)
        self.metrics.set_engine_stats(
            {
                "num_requests_running": sum(s.get("num_requests_running", 0.0) for s in live),
                "kv_cache_usage_perc": sum(s.get("kv_cache_usage_perc", 0.0) for s in live)
                / len(live),
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                **_spec_decode_totals(live),
            }
        )


def _spec_decode_totals(live: list[Mapping[str, float]]) -> dict[str, float]:
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
