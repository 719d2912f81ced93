"""RemoteReplica: a replica that is another fleetserve server (a Kubernetes pod) reached
over HTTP, so that one gateway routes, queues and migrates over pods as it does over
local engine processes.

RemoteReplica is a LocalReplica whose engine client is a `RemoteEngine`: the load
accounting, seats per class level, drain and eviction are the same code. RemoteEngine
sends each request to the pod's `/internal/v1/replica/generate` (serve/remote/wire.py;
the pod admits it into its own class queue and replicas) on one keep-alive httpx client,
and polls the pod's `/internal/v1/replica/load` every `poll_interval_s` for its health
and figures. What may end a request's stream:
- the pod's connection fails, resets or ends early, or it answers 5xx: ReplicaGoneError,
  so that the gateway resumes the request on another replica;
- the pod refuses the input (400): ValueError, as a local engine would;
- the pod refuses the gateway itself (401, 404: a deployment error): EngineDeadError.
A pod that says it is draining (SIGTERM) is unhealthy at once and gives its replica a
notice with the pod's drain deadline, so the service drains it (short requests finish
there, the rest move). A pod that stops answering for `dead_after_s` is dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from fleetserve.config import EngineConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    ReplicaGoneError,
)
from fleetserve.engine.stats import EngineStats
from fleetserve.engine.wire import CoreNotice
from fleetserve.outputs import RequestOutput
from fleetserve.serve.remote.stream import RemoteStream, error_code, error_message
from fleetserve.serve.remote.wire import (
    GENERATE_PATH,
    LOAD_PATH,
    MSGPACK,
    ErrorFrame,
    FrameReader,
    GenerateRequest,
    LoadReport,
    params_to_http,
)
from fleetserve.serve.replicas.local import LocalReplica

_CONNECT_TIMEOUT_S = 3.0

log = logging.getLogger("fleetserve.serve")


class RemoteEngine:
    """The engine client (serve/replicas/engine_client.py) of one pod's model."""

    def __init__(
        self,
        url: str,
        model: str,
        config: EngineConfig,
        api_key: str | None = None,
        poll_interval_s: float = 0.5,
        dead_after_s: float = 2.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.config = config
        self.poll_interval_s = poll_interval_s
        self.dead_after_s = dead_after_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.num_kv_blocks: int | None = None
        self.max_num_seqs: int | None = None
        self.dead_reason: str | None = None
        self.crashed = False  # a pod's exit is not this process's crash
        # The adapters the pod's engines hold, from its load report (the gateway's
        # replica adds those it sent there since: LocalReplica.lora_names).
        self.lora_loaded: frozenset[str] = frozenset()
        self.on_stats: Callable[[EngineStats], None] | None = None
        self.on_notice: Callable[[Any], None] | None = None
        self.report: LoadReport | None = None
        self._pod_steps = 0
        self._num_steps = 0
        self._step_latency_s: float | None = None
        self._reachable = False
        self._draining = False
        self._unreachable_since: float | None = None
        self._streams: dict[str, RemoteStream] = {}
        self._client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def is_ready(self) -> bool:
        healthy = self.report is not None and self.report.healthy
        return self._reachable and healthy and not self._draining and self.dead_reason is None

    @property
    def core_pid(self) -> int | None:
        return None  # it runs elsewhere

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> None:
        """Returns once the pod answers that it serves the model; RuntimeError if it does
        not within `timeout_s` (a pod that is still loading is waited for)."""
        timeout = httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S)
        self._client = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=timeout)
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while not self.is_ready:
            if self.dead_reason is not None:
                raise RuntimeError(f"the pod at {self.url}: {self.dead_reason}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pod at {self.url} was not ready within {timeout_s:g} s "
                                   f"({last})")  # fmt: skip
            last = await self._poll() or last
            if not self.is_ready:
                await asyncio.sleep(min(self.poll_interval_s, 0.2))
        self._unreachable_since = None
        self._poller = asyncio.create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(self.poll_interval_s)
            try:
                error = await self._poll()
            except Exception as e:  # a bug in one round must not stop the watch
                log.exception("polling the pod at %s failed", self.url)
                error = f"{type(e).__name__}: {e}"
            now = time.monotonic()
            if error is None:
                self._unreachable_since = None
            elif self._unreachable_since is None:
                self._unreachable_since = now
            elif now - self._unreachable_since > self.dead_after_s:
                self._fail_all(f"the pod at {self.url} stopped answering ({error})")

    async def _poll(self) -> str | None:
        """Reads the pod's load report; returns what went wrong, None if all went well."""
        assert self._client is not None
        try:
            resp = await self._client.get(
                LOAD_PATH, params={"model": self.model}, timeout=max(1.0, self.poll_interval_s * 4)
            )
        except httpx.HTTPError as e:
            self._reachable = False
            return f"{type(e).__name__}: {e}"
        if resp.status_code != 200:
            self._reachable = False
            message = error_message(resp.content)
            if resp.status_code in (401, 403, 404):
                self._fail_all(f"the pod at {self.url} refused the gateway ({resp.status_code}: "
                               f"{message})")  # fmt: skip
            return f"{resp.status_code}: {message}"
        try:
            report = msgspec.json.decode(resp.content, type=LoadReport)
        except msgspec.DecodeError as e:
            self._reachable = False
            return f"a bad load report: {e}"
        self._reachable = True
        self._apply(report)
        return None

    def _apply(self, report: LoadReport) -> None:
        self.report = report
        self.lora_loaded = frozenset(report.lora_adapters)
        if report.kv_capacity_tokens is not None:
            self.num_kv_blocks = report.kv_capacity_tokens // self.config.cache.block_size
        self.max_num_seqs = report.max_num_seqs
        if report.draining:
            self._on_draining(report.drain_left_s)
        # The pod's step count restarts when its replicas do; the replica needs one that
        # only grows (a step is progress: a pod that makes none while holding work hangs).
        grown = report.num_steps - self._pod_steps
        self._num_steps += grown if grown >= 0 else report.num_steps
        self._pod_steps = report.num_steps
        if report.step_latency_s is not None:
            self._step_latency_s = report.step_latency_s
        stats = EngineStats(
            num_requests_running=report.num_requests_running,
            num_requests_waiting=report.queue_depth,
            kv_cache_usage_perc=report.kv_cache_usage_perc,
            # Steps count once the pod has a step latency (its replicas' EWMA, which
            # stands in for a latest step): a made-up 0 s would make its peers stragglers.
            num_steps=self._num_steps if self._step_latency_s is not None else 0,
            last_step_seconds=self._step_latency_s or 0.0,
            # The pod's hit rate as one query (the service pools hits over queries).
            prefix_cache_queries=1.0,
            prefix_cache_hits=report.prefix_cache_hit_rate,
        )
        if self.on_stats is not None:
            self.on_stats(stats)

    def _on_draining(self, left_s: float | None) -> None:
        if self._draining:
            return
        self._draining = True
        if self.on_notice is not None:
            deadline = time.time() + (left_s if left_s is not None else 0.0)
            self.on_notice(CoreNotice("pod", deadline, f"the pod at {self.url} is draining"))

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        for stream in list(self._streams.values()):
            stream.fail(ReplicaGoneError(reason))

    def kill(self) -> None:
        """A pod cannot be killed from here: its requests move and it is let go."""
        self._fail_all(f"the pod at {self.url} was let go (it hung)")

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self.dead_reason = self.dead_reason or "the replica was stopped"
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        if self._poller is not None:
            tasks.append(self._poller)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        priority: int = 0,
        resume: RequestOutput | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RemoteStream:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._client is None or self.num_kv_blocks is None:
            raise EngineNotReadyError(f"the pod at {self.url} is not connected yet")
        ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        body = self._encoder.encode(
            GenerateRequest(
                # An adapter is named as the model, as a client names it; the pod's
                # registry knows it (the same fleet file's `adapters:`).
                self.model if lora_request is None else lora_request.lora_name,
                request_id,
                ids,
                params_to_http(params),
                text,
                priority,
                resume,
            )  # fmt: skip
        )
        stream = RemoteStream(self._release, request_id, params.n)
        reader = FrameReader(request_id, text, ids)
        self._streams[request_id] = stream
        stream.task = asyncio.create_task(self._run(stream, body, reader))
        return stream

    async def _run(self, stream: RemoteStream, body: bytes, reader: FrameReader) -> None:
        assert self._client is not None
        headers = {"Content-Type": MSGPACK}
        try:
            async with self._client.stream("POST", GENERATE_PATH, content=body,
                                           headers=headers) as resp:  # fmt: skip
                if resp.status_code != 200:
                    stream.fail(self._refusal(resp.status_code, await resp.aread()))
                    return
                async for chunk in resp.aiter_bytes():
                    for frame in reader.feed(chunk):
                        if isinstance(frame, ErrorFrame):
                            stream.fail(self._frame_error(frame))
                            return
                        out = reader.delta(frame)
                        stream.started = True
                        stream.deltas.put(out)
                        if out.finished:
                            return
            stream.fail(ReplicaGoneError(f"the pod at {self.url} ended the stream unfinished"))
        except httpx.HTTPError as e:
            self._reachable = False  # until the next poll says otherwise
            stream.fail(ReplicaGoneError(f"lost the pod at {self.url}: {type(e).__name__}: {e}"))
        except (msgspec.DecodeError, ValueError) as e:
            stream.fail(ReplicaGoneError(f"a bad frame from {self.url}: {e}"))

    def _refusal(self, status: int, raw: bytes) -> Exception:
        message = error_message(raw)
        if status in (400, 413, 422):
            return ValueError(message)
        if status == 503 and error_code(raw) == "draining":
            self._on_draining(None)
        if status >= 500 or status in (408, 429):
            return ReplicaGoneError(f"the pod at {self.url} answered {status}: {message}")
        return EngineDeadError(f"the pod at {self.url} refused the request ({status}: {message})")

    def _frame_error(self, frame: ErrorFrame) -> Exception:
        if frame.retry_elsewhere:
            return ReplicaGoneError(f"the pod at {self.url}: {frame.message}")
        if frame.status == 400:
            return ValueError(frame.message)
        return EngineDeadError(f"the pod at {self.url}: {frame.message}")

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()

    def abort_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            stream.fail(EngineDeadError(reason))

    def _release(self, stream: RemoteStream) -> None:
        self._streams.pop(stream.request_id, None)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()  # closes its HTTP stream: the pod aborts the request


class RemoteReplica(LocalReplica):
    """A fleetserve server's model as one replica (its `pid` is None: it runs elsewhere).
    Its seats per class level follow the pod's own batch size, read from the pod."""

    def __init__(
        self,
        index: int,
        url: str,
        model: str,
        config: EngineConfig,
        api_key: str | None = None,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.url = url
        engine = RemoteEngine(url, model, config, api_key, poll_interval_s)
        super().__init__(index, engine, max_num_seqs=config.scheduler.max_num_seqs)
        self.remote = engine

    async def start(self, timeout_s: float = 600.0) -> None:
        await self.remote.start(timeout_s)
        self.max_num_seqs = self.remote.max_num_seqs or self.max_num_seqs
