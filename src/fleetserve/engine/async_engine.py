"""AsyncEngine: the API process's client of one EngineCore process.

Tokenization, validation, detokenization and stop strings happen here (OutputProcessor);
the core process only schedules and steps. Requests go out on a ZeroMQ PUSH socket;
outputs come back on a PULL socket read by one asyncio task, which puts each request's
delta (outputs.py) on that request's DeltaQueue: its reader gets the new tokens, text and
logprobs, merged when it fell behind. A request's stream that is closed before it
finishes (client gone, handler cancelled) aborts the request in the core.

Safe to call only from the event loop thread that ran `start()`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from fleetserve.cloud.notices import NoticeConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.delta_stream import (
    DeltaStream,
    EngineDeadError,
    ReplicaGoneError,
)
from fleetserve.engine.output_processor import OutputProcessor
from fleetserve.engine.prompt_rules import PromptRules, PromptType
from fleetserve.engine.stats import EngineStats
from fleetserve.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreFailure,
    CoreMessage,
    CoreNotice,
    CoreOutputs,
    CoreReady,
    EngineSpec,
    Shutdown,
    StopRequests,
    WireLoRA,
    params_to_wire,
)
from fleetserve.lora.metrics import LoRAMetrics
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import RequestOutput
from fleetserve.tokenizer import Tokenizer


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


def resume_tokens(resume: RequestOutput) -> list[list[int] | None]:
    """Per child of a resumed request: the tokens it had (None: it had finished)."""
    return [None if c.finished else list(c.token_ids) for c in resume.outputs]


class RequestStream(DeltaStream):
    """One request's deltas from the local engine core (a slow reader gets the merged
    delta of what it missed); `close()` aborts the request in the core if it has not
    finished."""

    def __init__(self, engine: AsyncEngine, request_id: str, n: int) -> None:
        super().__init__(request_id, n, engine._release)  # type: ignore[arg-type]


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs,
        max_waiting_requests: int = 256,
        metrics: ModelMetrics | None = None,
        data_parallel_rank: int = 0,
        *,
        sigterm_grace_s: float = 15.0,
        notice: NoticeConfig | None = None,
    ) -> None:
        """`sigterm_grace_s`: how long the core serves on after a SIGTERM; `notice`: the
        spot-notice source its core polls (a spot pool's), if any."""
        self.args = args
        self.data_parallel_rank = data_parallel_rank
        self.config, self.source = args.resolve()
        self.tokenizer = Tokenizer.from_source(self.source)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._rules = PromptRules(self.tokenizer, self.config)
        self.eos_token_ids = sorted(
            set(self.config.model.eos_token_ids) | set(self.tokenizer.stop_token_ids)
        )
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.num_kv_blocks: int | None = None
        self.dead_reason: str | None = None
        self.crashed = False  # the core process exited without being asked to
        self.stats: EngineStats | None = None  # after its first step
        # LoRA: the adapters the engine holds in memory (from its last outputs), and the
        # adapter of each request in flight (for the per-adapter token counts).
        self.lora_loaded: frozenset[str] = frozenset()
        # The core's running totals of adapter loads and evictions (by adapter name).
        self.lora_loads: dict[str, int] = {}
        self.lora_evictions: dict[str, int] = {}
        self._lora_of: dict[str, str] = {}
        self._lora_metrics_obj: LoRAMetrics | None = None
        # Called with every step's stats (a data-parallel frontend tracks its replicas).
        self.on_stats: Callable[[EngineStats], None] | None = None
        # Called when the core says it will be taken away (SIGTERM, a spot notice).
        self.on_notice: Callable[[CoreNotice], None] | None = None
        self.sigterm_grace_s = sigterm_grace_s
        self.notice = notice
        self._streams: dict[str, RequestStream] = {}
        self._num_unstarted = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def is_ready(self) -> bool:
        return self.num_kv_blocks is not None and self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="fleetserve-")
        in_addr = f"ipc://{self._tmpdir}/input"
        out_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.asyncio.Context()
        self._in_sock = self._ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.SNDHWM, 0)  # bounded by max_waiting_requests instead
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.bind(in_addr)
        self._out_sock = self._ctx.socket(zmq.PULL)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        self._out_sock.bind(out_addr)
        # An engine dropped without shutdown() (a test, a failed start) must not leave its
        # context to the garbage collector: collected in one cycle with its sockets, the
        # context's __del__ sees no live sockets to close (their weak references are
        # already cleared) and term() then waits for them for ever, hanging whatever
        # allocation triggered the collection. The finalizer holds the three strongly, so
        # they are never cycle garbage, and closes the sockets before term().
        self._zmq_close = weakref.finalize(
            self, _close_zmq, self._ctx, self._in_sock, self._out_sock
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)  # type: ignore[arg-type]
        spec = EngineSpec(
            self.args,
            in_addr,
            out_addr,
            os.getpid(),
            self.data_parallel_rank,
            self.sigterm_grace_s,
            self.notice,
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fleetserve.engine.core_proc", msgspec.json.encode(spec)],
        )
        self._tasks.append(asyncio.create_task(self._watch_process()))
        try:
            msg = await asyncio.wait_for(self._recv(), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise RuntimeError(f"the engine did not load within {timeout_s:.0f} s") from None
        if isinstance(msg, CoreFailure):
            raise RuntimeError(msg.message)
        if not isinstance(msg, CoreReady):
            raise RuntimeError(f"unexpected first message from the engine: {msg!r}")
        self.num_kv_blocks = msg.num_kv_blocks
        self._block_size = msg.block_size
        self._tasks.append(asyncio.create_task(self._output_loop()))

    async def _recv(self) -> CoreMessage:
        while True:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if await self._out_sock.poll(200):
                return self._decoder.decode(await self._out_sock.recv())

    async def _watch_process(self) -> None:
        assert self._proc is not None
        await _process_exit(self._proc)
        if self.dead_reason is None:
            self.crashed = True
            self._fail_all(f"the engine process exited (code {self._proc.returncode})")

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        if self.metrics is not None:
            self.metrics.clear_engine_stats()  # a dead engine runs and holds nothing
        for stream in list(self._streams.values()):
            stream.fail(ReplicaGoneError(reason))

    def kill(self) -> None:
        """SIGKILL the core now (a hung one cannot be asked to stop)."""
        if self._proc is not None and self._proc.poll() is None:
            self.dead_reason = self.dead_reason or "the engine was killed"
            self._proc.kill()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self.dead_reason = self.dead_reason or "the engine is shutting down"
            self._send(Shutdown())
            for signal_step in (None, proc.terminate, proc.kill):
                if signal_step is not None:
                    signal_step()
                try:
                    await asyncio.to_thread(proc.wait, timeout_s / 2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._ctx is not None:
            self._zmq_close()
            self._ctx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    @property
    def core_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        resume: RequestOutput | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and submit; raises ValueError for bad input before anything is sent.
        `resume`: the request's last output seen on a replica that was lost; it goes on
        from there (see OutputProcessor.add_request). `lora_request`: the adapter it runs
        with (None: the base model); a resumed request keeps it."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.num_kv_blocks is None:
            raise EngineNotReadyError("the model is still loading")
        if self._num_unstarted >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"{self._num_unstarted} requests are already waiting; try again later"
            )
        text, ids = self._rules.tokenize_prompt(prompt)
        self._rules.validate(ids, params)
        self._rules.fit_kv(len(ids), params, self.num_kv_blocks * self._block_size)
        child_ids = self.output_processor.add_request(request_id, text, ids, params, resume)
        try:
            # Encoded before anything is counted: a message that cannot be encoded fails
            # here and leaves no trace.
            outputs = [[] for _ in child_ids] if resume is None else resume_tokens(resume)
            if any(outputs):  # the prompt's logprobs were already sent
                params = replace(params, prompt_logprobs=None)
            group = request_id if len(child_ids) > 1 else None
            messages = [
                self._encoder.encode(
                    AddRequest(
                        cid,
                        ids,
                        params_to_wire(params.for_choice(i)),
                        self.eos_token_ids,
                        priority,
                        group,
                        out,
                        WireLoRA.of(lora_request),
                    )
                )
                for i, (cid, out) in enumerate(zip(child_ids, outputs, strict=True))
                if out is not None
            ]
        except Exception:
            self.output_processor.abort(request_id)
            raise
        # The waiting slot is taken here and given back in one place, `_release` (via
        # stream.close()) or the first output; if sending fails, closing gives it back.
        stream = RequestStream(self, request_id, params.n)
        self._streams[request_id] = stream
        self._num_unstarted += 1
        try:
            for raw in messages:
                self._in_sock.send(raw, copy=False)
        except BaseException:
            stream.close()
            raise
        if self.metrics is not None and resume is None:
            self.metrics.add_prompt_tokens(len(ids))
            if lora_request is not None:
                self._lora_metrics().add_request(lora_request.lora_name, len(ids))
        if lora_request is not None:
            self._lora_of[request_id] = lora_request.lora_name
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        resume: RequestOutput | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id, prompt, params, priority, resume, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()

    def abort_all(self, reason: str, error: type[EngineDeadError] = EngineDeadError) -> None:
        """Ends every open stream with `error(reason)`; closing them aborts them."""
        for stream in list(self._streams.values()):
            stream.fail(error(reason))

    def _release(self, stream: RequestStream) -> None:
        """A stream was closed: forget it, and abort it in the core if it was unfinished."""
        if self._streams.pop(stream.request_id, None) is None:
            return
        self._lora_of.pop(stream.request_id, None)
        if not stream.started:
            self._num_unstarted -= 1
        if stream.finished:
            return
        child_ids = self.output_processor.child_ids(stream.request_id)
        self.output_processor.abort(stream.request_id)
        if child_ids and self.dead_reason is None:
            self._send(AbortRequests(child_ids))
        if self.metrics is not None and child_ids and not stream.lost:
            self.metrics.add_finished("abort", len(child_ids))

    def _send(self, msg: Any) -> None:
        # PUSH with no high-water mark never blocks; the returned future is already done.
        self._in_sock.send(self._encoder.encode(msg), copy=False)

    async def _output_loop(self) -> None:
        while True:
            try:
                msg = await self._recv()
            except EngineDeadError:
                return
            if isinstance(msg, CoreOutputs):
                self._handle_outputs(msg)
            elif isinstance(msg, CoreNotice) and self.on_notice is not None:
                self.on_notice(msg)

    def _lora_metrics(self) -> LoRAMetrics:
        assert self.metrics is not None
        if self._lora_metrics_obj is None:
            self._lora_metrics_obj = LoRAMetrics(self.metrics)
        return self._lora_metrics_obj

    def _handle_outputs(self, msg: CoreOutputs) -> None:
        self.stats = msg.stats
        if msg.lora is not None:
            self.lora_loaded = frozenset(msg.lora.loaded)
            self.lora_loads, self.lora_evictions = dict(msg.lora.loads), dict(msg.lora.evictions)
            if self.metrics is not None:
                self._lora_metrics().set_engine_totals(
                    self.data_parallel_rank, msg.lora.loads, msg.lora.evictions
                )
        if self.metrics is not None:
            self.metrics.set_engine_stats(msg.stats.as_metrics(), self.data_parallel_rank)
        if self.on_stats is not None:
            self.on_stats(msg.stats)
        for req_id, reason in msg.rejected:
            parent = self.output_processor.child_to_parent.get(req_id)
            stream = self._streams.get(parent) if parent is not None else None
            if stream is not None:
                stream.fail(ValueError(reason))
        core_outputs = [w.to_core_output() for w in msg.outputs]
        if self.metrics is not None:
            self.metrics.add_generation_tokens(sum(len(o.new_token_ids) for o in core_outputs))
            if self._lora_of:
                lora = self._lora_metrics()
                for o in core_outputs:
                    parent = self.output_processor.child_to_parent.get(o.req_id)
                    name = self._lora_of.get(parent) if parent is not None else None
                    if name is not None:
                        lora.add_generation_tokens(name, len(o.new_token_ids))
        outputs, to_stop = self.output_processor.process(core_outputs)
        if to_stop:
            self._send(StopRequests(to_stop))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if not stream.started:
                stream.started = True
                self._num_unstarted -= 1
            if self.metrics is not None:
                self.metrics.observe_finished(out)
            stream.deltas.put(out)


async def _process_exit(proc: subprocess.Popen[bytes]) -> None:
    """Returns once `proc` has exited: at once on Linux (its pidfd turns readable when it
    dies, so a SIGKILLed engine is noticed in milliseconds), else by polling every 50 ms."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or the process is gone already
        fd = None
    if fd is not None:
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, on_exit)
        try:
            if proc.poll() is None:
                await exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    while proc.poll() is None:  # reaps it; after the pidfd said so, returns at once
        await asyncio.sleep(0.05)


def _close_zmq(ctx: zmq.asyncio.Context, *socks: zmq.asyncio.Socket) -> None:
    for sock in socks:
        sock.close(0)
    ctx.term()
