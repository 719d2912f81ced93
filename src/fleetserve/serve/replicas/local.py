"""LocalReplica: the `Replica` (serve/contracts.py) whose engine is a local EngineCore process,
reached through an AsyncEngine (ipc sockets, msgpack), with the load figures the router
and the model service read. serve/remote/replica.py's RemoteReplica is the same replica over
another engine client (serve/replicas/engine_client.py): a fleetserve server reached over HTTP.

The replica owns those figures and changes them only through its own methods, all called
on the event loop thread: `submit` adds a request's work, its `ReplicaStream` retires the
work as outputs arrive (the first output means the prompt is prefilled; each generated
token is one fewer to go) and settles the rest when the request ends, and every stats
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

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import ReplicaGoneError
from fleetserve.engine.llm_engine import PromptType
from fleetserve.engine.wire import CoreNotice
from fleetserve.outputs import RequestOutput
from fleetserve.serve.contracts import StreamObserver
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
        self.pool = "default"
        self.capacity = "on_demand"
        self.ewma_alpha = ewma_alpha
        self.warmup_steps = warmup_steps
        self.max_num_seqs = max_num_seqs
        self.num_outstanding_requests = 0
        self.num_outstanding_tokens = 0
        self.num_routed = 0
        self.draining = False
        self._num_evicted = 0
        self._seqs_by_level: Counter[int] = Counter()
        # Called whenever a request of this replica ends (its seats are free again).
        self.on_finish: Callable[[Any], None] | None = None
        self._step_latency_ewma: float | None = None
        self.num_steps = 0
        self.stats: dict[str, float] = {}
        # Called after each stats update (the data-parallel engine republishes gauges).
        self.on_stats: Callable[[Any], None] | None = None
        # Called with (replica, notice) when its engine says it will be taken away.
        self.on_notice: Callable[[Any, CoreNotice], None] | None = None
        self.notice: CoreNotice | None = None
        engine.on_stats = self._update_stats
        engine.on_notice = self._on_notice
        self._streams: dict[str, ReplicaStream] = {}
        # When its engine last made progress (a step that ran) or, if it was idle, got
        # work: a replica that holds work and makes none for long is hung.
        self.last_progress = time.monotonic()

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
            for stream in list(self._streams.values()):
                if stream.num_ungenerated * step_s > timeout_s:
                    self._evict(stream, "the replica is being drained")
        while self.num_outstanding_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        clean = self.num_outstanding_requests == 0 and not self._num_evicted
        if migrate:
            for stream in list(self._streams.values()):
                self._evict(stream, "the replica was drained")
        return clean

    def _evict(self, stream: ReplicaStream, reason: str) -> None:
        if not stream.inner.finished and not stream.inner.closed:
            self._num_evicted += 1
            stream.inner.queue.put_nowait(ReplicaGoneError(reason))

    def evict_all(self, reason: str) -> None:
        """Hands every request it holds over to the other replicas (ReplicaGoneError)."""
        for stream in list(self._streams.values()):
            self._evict(stream, reason)

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
        return int(self.stats.get("num_requests_waiting", 0))

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.stats.get("prefix_cache_queries", 0.0)
        return self.stats.get("prefix_cache_hits", 0.0) / queries if queries else 0.0

    def _update_stats(self, stats: dict[str, float]) -> None:
        self.stats = stats
        num_steps = int(stats.get("num_steps", 0))
        if num_steps > self.num_steps:  # stats also come after steps that ran nothing
            self.last_progress = time.monotonic()
            latest = stats.get("last_step_seconds", 0.0)
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
        observer: StreamObserver | None = None,
        resume: RequestOutput | None = None,
    ) -> ReplicaStream:
        """Hands the request to this replica's engine (raising what `add_request` raises).
        `priority` is the engine's (class and request folded, serve/admission/sla.py); `level` the
        class's, for `has_room`; `resume` the output it goes on from (migration)."""
        inner = self.engine.add_request(request_id, prompt, params, priority, resume)
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
        stream = ReplicaStream(
            self, inner, num_prompt, num_new_tokens - num_done, level, observer, num_done
        )
        self._streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _retire(self, num_tokens: int) -> None:
        self.num_outstanding_tokens -= num_tokens

    def _finish(self, stream: ReplicaStream, num_tokens_left: int) -> None:
        self._streams.pop(stream.request_id, None)
        level, num_seqs = stream.level, stream.n
        self.num_outstanding_tokens -= num_tokens_left
        self.num_outstanding_requests -= 1
        self._seqs_by_level[level] -= num_seqs
        if self._seqs_by_level[level] == 0:
            del self._seqs_by_level[level]
        if self.on_finish is not None:
            self.on_finish(self)


class ReplicaStream:
    """A replica's RequestStream that retires the request's outstanding work on its
    replica as outputs arrive; same iteration and `close()` as RequestStream."""

    def __init__(
        self,
        replica: LocalReplica,
        inner: EngineStream,
        num_prompt_tokens: int,
        num_new: int,
        level: int = 0,
        observer: StreamObserver | None = None,
        num_generated: int = 0,
    ) -> None:
        self.replica = replica
        self.level = level
        self.observer = observer
        self.inner = inner
        self.request_id = inner.request_id
        self.n = inner.n
        self._num_unprefilled = num_prompt_tokens
        self._num_ungenerated = num_new
        self._num_generated = num_generated
        self._settled = False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self.inner.__anext__()
        except Exception:  # StopAsyncIteration included: the request is over either way
            self._settle()
            raise
        self._observe(out)
        return out

    def _observe(self, out: RequestOutput) -> None:
        if self._settled:
            return
        if self.observer is not None:
            self.observer.on_output(out)
        # Outputs are cumulative (a slow reader may skip some), so count from the total.
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        new = min(max(num_generated - self._num_generated, 0), self._num_ungenerated)
        self._num_generated = num_generated
        self.replica._retire(self._num_unprefilled + new)
        self._num_unprefilled = 0
        self._num_ungenerated -= new
        if out.finished:
            self._settle()

    def _settle(self) -> None:
        if not self._settled:
            self._settled = True
            if self.observer is not None:
                self.observer.on_end()
            self.replica._finish(self, self._num_unprefilled + self._num_ungenerated)

    @property
    def num_ungenerated(self) -> int:
        """Tokens it may still generate (max_tokens times n, less those it has)."""
        return self._num_ungenerated

    def close(self) -> None:
        self.inner.close()
        self._settle()

    def __getattr__(self, name: str) -> Any:  # started, finished, closed, queue, ...
        return getattr(self.inner, name)
