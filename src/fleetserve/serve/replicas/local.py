"""LocalReplica: the `Replica` (serve/contracts.py) whose engine is a local EngineCore process,
reached through an AsyncEngine (ipc sockets, msgpack), with the load figures the router
and the model service read. serve/remote/replica.py's RemoteReplica is the same replica over
another engine client (serve/replicas/engine_client.py): a fleetserve server reached over HTTP.

The replica owns those figures and changes them only through its own methods, all called
on the event loop thread: `submit` adds a request's work and listens to the request's
engine stream (its `_Work`), which retires the work as deltas arrive (the first delta
means the prompt is prefilled; each generated token is one fewer to go) and settles the
rest when the request ends, and every stats
message of the core (one per engine step) updates the step-latency EWMA. It also counts
the sequences it holds per class level, which is how the model service knows whether a
request of some class may be sent to it now (`has_room`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import ReplicaGoneError
from fleetserve.engine.prompt_rules import PromptType
from fleetserve.engine.stats import EngineStats
from fleetserve.engine.wire import CoreNotice
from fleetserve.outputs import RequestOutput
from fleetserve.serve.replicas.engine_client import EngineClient, EngineStream


class LocalReplica:
    """`ewma_alpha` is the weight of each new step time. Step time grows with the work in
    the step (a long prefill chunk), so the EWMA is slow to move and is reported only after
    `warmup_steps` steps: a few heavy steps alone should not make a replica a straggler.
    `max_num_seqs` is the engine's batch size: the seats `has_room` hands out per level.
    `oversubscribe` maps a class level to a factor (>= 1) of those seats that the level may
    fill: a level given 2 sends up to two batches' worth, so that the engine keeps a queue
    of that level's requests to refill its batch from at once (default 1: one batch)."""

    def __init__(
        self,
        index: int,
        engine: EngineClient,
        ewma_alpha: float = 0.1,
        warmup_steps: int = 8,
        max_num_seqs: int = 64,
        oversubscribe: Mapping[int, float] | None = None,
        *,
        pool: str = "default",
        capacity: str = "on_demand",
    ) -> None:
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha}")
        self._seats: dict[int, int] = {}  # levels with more seats than one batch
        for level, factor in (oversubscribe or {}).items():
            if not factor >= 1.0:
                raise ValueError(f"oversubscribe of level {level} must be >= 1, got {factor}")
            self._seats[level] = int(max_num_seqs * factor)
        self.index = index
        self.engine = engine
        # The pool it belongs to and that pool's capacity (serve/replicas/pool_plan.py).
        self.pool = pool
        self.capacity = capacity
        self.ewma_alpha = ewma_alpha
        self.warmup_steps = warmup_steps
        self.max_num_seqs = max_num_seqs
        self.num_outstanding_requests = 0
        self.num_outstanding_tokens = 0
        self.num_routed = 0
        # Adapters sent here that its engine has not yet reported loaded: it is loading
        # them, so routing counts them as held.
        self._routed_loras: set[str] = set()
        self.draining = False
        self._num_evicted = 0
        self._seqs_by_level: Counter[int] = Counter()
        # Called whenever a request of this replica ends (its seats are free again).
        self.on_finish: Callable[[Any], None] | None = None
        self._step_latency_ewma: float | None = None
        self.num_steps = 0
        self.stats: EngineStats | None = None  # its engine's, after its first step
        # Called after each stats update (the data-parallel engine republishes gauges).
        self.on_stats: Callable[[Any], None] | None = None
        # Called with (replica, notice) when its engine says it will be taken away.
        self.on_notice: Callable[[Any, CoreNotice], None] | None = None
        self.notice: CoreNotice | None = None
        engine.on_stats = self._update_stats
        engine.on_notice = self._on_notice
        self._work: dict[str, _Work] = {}
        # When its engine last made progress (a step that ran) or, if it was idle, got
        # work: a replica that holds work and makes none for long is hung.
        self.last_progress = time.monotonic()

    @property
    def lora_names(self) -> frozenset[str]:
        loaded = self.engine.lora_loaded
        self._routed_loras -= loaded
        return loaded | self._routed_loras

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> None:
        await self.engine.start(timeout_s)

    async def drain(self, timeout_s: float, migrate: bool = True) -> bool:
        """Takes no new requests from now on and lets the ones it holds finish for up to
        `timeout_s`; with `migrate`, the requests not expected to finish in that time are
        handed over (ReplicaGoneError: their service resumes them on another replica) at
        once, and whatever still runs at the end is handed over then. True if every
        request finished here."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        if migrate:
            step_s = self.step_latency_s or self._step_latency_ewma or 0.05
            for work in list(self._work.values()):
                if work.num_ungenerated * step_s > timeout_s:
                    self._evict(work, "the replica is being drained")
        while self.num_outstanding_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        clean = self.num_outstanding_requests == 0 and not self._num_evicted
        if migrate:
            for work in list(self._work.values()):
                self._evict(work, "the replica was drained")
        return clean

    def _evict(self, work: _Work, reason: str) -> None:
        stream = work.stream
        if not stream.finished and not stream.closed:
            self._num_evicted += 1
            stream.fail(ReplicaGoneError(reason))

    def evict_all(self, reason: str) -> None:
        """Hands every request it holds over to the other replicas (ReplicaGoneError)."""
        for work in list(self._work.values()):
            self._evict(work, reason)

    async def stop(self, kill: bool = False) -> None:
        """Hands its open requests over (ReplicaGoneError) and shuts its engine process
        down; `kill` SIGKILLs it first (a hung engine cannot be asked)."""
        self.draining = True
        self.evict_all("the replica was stopped")
        if kill:
            self.engine.kill()
        await self.engine.shutdown()

    def hung_for(self, now: float) -> float:
        """Seconds it has held work without an engine step; 0 when idle or progressing."""
        if self.num_outstanding_requests == 0 or self.dead_reason is not None:
            return 0.0
        return now - self.last_progress

    def _on_notice(self, notice: CoreNotice) -> None:
        if self.notice is None:
            self.notice = notice
            if self.on_notice is not None:
                self.on_notice(self, notice)

    @property
    def pid(self) -> int | None:
        return self.engine.core_pid

    @property
    def dead_reason(self) -> str | None:
        return self.engine.dead_reason

    @property
    def crashed(self) -> bool:
        return self.engine.crashed

    @property
    def kv_capacity_tokens(self) -> int | None:
        blocks = self.engine.num_kv_blocks
        return None if blocks is None else blocks * self.engine.config.cache.block_size

    def abort_all(self, reason: str) -> None:
        self.engine.abort_all(reason)

    # ------------------------------------------------------------- load
    @property
    def healthy(self) -> bool:
        """Its engine is up and it takes new requests (not draining)."""
        return self.engine.is_ready and not self.draining

    def has_room(self, level: int, num_seqs: int) -> bool:
        """Whether a request of `num_seqs` sequences at class level `level` (lower is more
        important) may be sent now: the sequences it holds at this level or more important
        ones leave room in one batch. Less important work never blocks more important work:
        the engine's priority scheduler preempts it. An idle level always has room, so a
        request wider than the batch still runs.

        An oversubscribed level (a less important class, say `batch`) may hold more than a
        batch: the surplus waits in the engine's own queue, which refills a finished
        sequence's slot on the very next step instead of after a round trip through this
        process. A more important level is not affected: it counts only its own and more
        important sequences, and the engine's priority order puts it ahead of the surplus."""
        used = sum(n for lv, n in self._seqs_by_level.items() if lv <= level)
        seats = self._seats.get(level, self.max_num_seqs)
        return used == 0 or used + num_seqs <= seats

    @property
    def step_latency_s(self) -> float | None:
        """EWMA of the core's step time; None until `warmup_steps` steps have run."""
        return self._step_latency_ewma if self.num_steps >= self.warmup_steps else None

    @property
    def queue_depth(self) -> int:
        """Requests waiting in the core's scheduler at its last step."""
        return self.stats.num_requests_waiting if self.stats is not None else 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        stats = self.stats
        if stats is None or not stats.prefix_cache_queries:
            return 0.0
        return stats.prefix_cache_hits / stats.prefix_cache_queries

    def _update_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        num_steps = stats.num_steps
        if num_steps > self.num_steps:  # stats also come after steps that ran nothing
            self.last_progress = time.monotonic()
            latest = stats.last_step_seconds
            prev = self._step_latency_ewma
            a = self.ewma_alpha
            self._step_latency_ewma = latest if prev is None else a * latest + (1 - a) * prev
            self.num_steps = num_steps
        if self.on_stats is not None:
            self.on_stats(self)

    def submit(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int,
        num_prompt_tokens: int,
        level: int = 0,
        resume: RequestOutput | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineStream:
        """Hands the request to this replica's engine (raising what `add_request` raises)
        and returns its engine stream, whose deltas retire its work here as they are read.
        `priority` is the engine's (class and request folded, serve/admission/sla.py);
        `level` the class's, for `has_room`; `resume` the output it goes on from;
        `lora_request` the adapter it runs with (None: the base model)."""
        if lora_request is None:
            stream = self.engine.add_request(request_id, prompt, params, priority, resume)
        else:
            stream = self.engine.add_request(
                request_id, prompt, params, priority, resume, lora_request=lora_request
            )
            self._routed_loras.add(lora_request.lora_name)
        # add_request has filled in max_tokens when the client left it out.
        num_new_tokens = (params.max_tokens or 0) * params.n
        num_done = 0 if resume is None else sum(len(c.token_ids) for c in resume.outputs)
        num_prompt = num_prompt_tokens + num_done  # what it prefills here
        if self.num_outstanding_requests == 0:
            self.last_progress = time.monotonic()
        self.num_outstanding_requests += 1
        self.num_outstanding_tokens += num_prompt + num_new_tokens - num_done
        self.num_routed += 1
        self._seqs_by_level[level] += params.n
        work = _Work(self, stream, num_prompt, num_new_tokens - num_done, level)
        stream.listener = work
        self._work[request_id] = work
        return stream

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _retire(self, num_tokens: int) -> None:
        self.num_outstanding_tokens -= num_tokens

    def _finish(self, work: _Work, num_tokens_left: int) -> None:
        self._work.pop(work.stream.request_id, None)
        level, num_seqs = work.level, work.stream.n
        self.num_outstanding_tokens -= num_tokens_left
        self.num_outstanding_requests -= 1
        self._seqs_by_level[level] -= num_seqs
        if self._seqs_by_level[level] == 0:
            del self._seqs_by_level[level]
        if self.on_finish is not None:
            self.on_finish(self)


class _Work:
    """One request's outstanding work on a replica: listens to its engine stream
    (engine/delta_stream.StreamListener) and retires the work as deltas are read."""

    def __init__(
        self,
        replica: LocalReplica,
        stream: EngineStream,
        num_prompt_tokens: int,
        num_new: int,
        level: int,
    ) -> None:
        self.replica = replica
        self.stream = stream
        self.level = level
        self._num_unprefilled = num_prompt_tokens
        self.num_ungenerated = num_new  # tokens it may still generate (max_tokens times n)
        self._settled = False

    def on_delta(self, delta: RequestOutput) -> None:
        if self._settled:
            return
        new = min(sum(len(c.token_ids) for c in delta.outputs), self.num_ungenerated)
        self.replica._retire(self._num_unprefilled + new)
        self._num_unprefilled = 0
        self.num_ungenerated -= new

    def on_end(self) -> None:
        if not self._settled:
            self._settled = True
            self.replica._finish(self, self._num_unprefilled + self.num_ungenerated)
