"""The EngineCore process: its step loop and its ZeroMQ sockets.

The API process binds two ipc:// sockets; this process connects to them and speaks the
messages of engine/wire.py (msgpack via msgspec structs, never pickle). The loop
drains its input without blocking between steps while requests run, blocks on input when
idle, reports engine stats after every step, and exits when the frontend says so or when
its parent process is gone.

SIGTERM is a notice, not an order: it is what Kubernetes sends a pod and what a spot
machine's shutdown sends its processes. The core tells the frontend (CoreNotice) and keeps
serving while the frontend moves its requests to other replicas (request migration); it
exits when the frontend sends Shutdown, at the notice's deadline, or on a second SIGTERM.
A cloud's spot notice (cloud/notices.py, polled in a thread) is handled the same way.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

import msgspec

from fleetserve.cloud.notices import NoticeConfig, NoticeThread, PreemptionNotice, make_watcher
from fleetserve.core.request import Request
from fleetserve.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreFailure,
    CoreInput,
    CoreNotice,
    CoreOutputs,
    CoreReady,
    EngineSpec,
    Shutdown,
    StopRequests,
    WireLoRAState,
    output_to_wire,
    params_from_wire,
)

if TYPE_CHECKING:
    import zmq

    from fleetserve.engine.core import EngineCore

# How long an idle core waits on input before checking that its parent is still alive.
_IDLE_POLL_MS = 500

# Test/debug hook, read here only: a core sleeps this long after every step that ran, as
# if its device were slower, and reports the sleep as step time. "0.05" slows every core;
# "1:0.05,2:0.1" slows data-parallel ranks 1 and 2 (straggler tests). Never set in production.
DEBUG_STEP_DELAY_ENV = "FLEETSERVE_DEBUG_STEP_DELAY_S"


def debug_step_delay_s(value: str | None, rank: int) -> float:
    """The delay `value` (the env var's format) gives data-parallel rank `rank`."""
    if not value:
        return 0.0
    try:
        for part in value.split(","):
            ranks, sep, seconds = part.rpartition(":")
            if not sep:
                return float(part)
            if int(ranks) == rank:
                return float(seconds)
    except ValueError:
        raise ValueError(
            f"{DEBUG_STEP_DELAY_ENV}={value!r}: expected SECONDS or RANK:SECONDS[,RANK:SECONDS]"
        ) from None
    return 0.0


# ------------------------------------------------------------------ the loop
class _Terminated(Exception):
    pass


class _Notices:
    """Preemption notices from the signal handler and the watcher thread, for the loop to
    send once each; the earliest deadline is when the core exits by itself."""

    def __init__(self, sigterm_grace_s: float) -> None:
        self.sigterm_grace_s = sigterm_grace_s
        self._lock = threading.Lock()
        self._unsent: list[CoreNotice] = []
        self.deadline: float | None = None
        self.sigterms = 0

    def add(self, notice: CoreNotice) -> None:
        with self._lock:
            self._unsent.append(notice)
            if self.deadline is None or notice.deadline < self.deadline:
                self.deadline = notice.deadline

    def take(self) -> list[CoreNotice]:
        with self._lock:
            out, self._unsent = self._unsent, []
            return out

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.sigterms += 1
        if self.sigterms > 1:
            raise _Terminated()
        deadline = time.time() + self.sigterm_grace_s
        self.add(CoreNotice("SIGTERM", deadline, f"drain within {self.sigterm_grace_s:g} s"))


_NOTICES = _Notices(15.0)


def _start_notice_watcher(cfg: NoticeConfig | None) -> NoticeThread | None:
    """Polls the cloud's metadata endpoint for a spot notice (None: no watcher)."""
    if cfg is None:
        return None

    def on_notice(n: PreemptionNotice) -> None:
        _NOTICES.add(CoreNotice(n.provider, n.deadline, n.detail, n.event_id))

    thread = NoticeThread(make_watcher(cfg), on_notice, cfg.poll_interval_s)
    thread.start()
    return thread


def run_core(spec: EngineSpec) -> int:
    import zmq

    from fleetserve.engine.core import EngineCore

    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 1000)
    out_sock.connect(spec.output_address)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(spec.input_address)
    encoder = msgspec.msgpack.Encoder()
    decoder: msgspec.msgpack.Decoder[CoreInput]
    decoder = msgspec.msgpack.Decoder(CoreInput)  # type: ignore[arg-type]
    core: EngineCore | None = None
    watcher = None
    _NOTICES.sigterm_grace_s = spec.sigterm_grace_s
    try:
        try:
            watcher = _start_notice_watcher(spec.notice)
            step_delay_s = debug_step_delay_s(
                os.environ.get(DEBUG_STEP_DELAY_ENV), spec.data_parallel_rank
            )
            config, source = spec.engine_args.resolve()
            core = EngineCore(config, source)
        except Exception as e:
            out_sock.send(encoder.encode(CoreFailure(f"engine failed to load: {e}")))
            raise
        out_sock.send(
            encoder.encode(
                CoreReady(
                    core.block_manager.num_blocks,
                    config.cache.block_size,
                    config.scheduler.max_model_len,
                )
            )
        )
        _loop(core, in_sock, out_sock, encoder, decoder, spec.parent_pid, step_delay_s)
        return 0
    except _Terminated:
        return 0
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        if watcher is not None:
            watcher.stop()
        if core is not None:
            core.shutdown()
        in_sock.close(0)
        out_sock.close(1000)
        ctx.term()


def _loop(
    core: EngineCore,
    in_sock: zmq.Socket[bytes],
    out_sock: zmq.Socket[bytes],
    encoder: msgspec.msgpack.Encoder,
    decoder: msgspec.msgpack.Decoder[CoreInput],
    ppid: int,
    step_delay_s: float = 0.0,
) -> None:
    import zmq

    poller = zmq.Poller()
    poller.register(in_sock, zmq.POLLIN)
    while True:
        busy = core.has_unfinished_requests()
        # Idle: block on input (waking now and then to notice an orphaned core).
        # Busy: only take what has already arrived, then step.
        events = dict(poller.poll(0 if busy else _IDLE_POLL_MS))
        rejected: list[tuple[str, str]] = []
        got_input = False
        while in_sock in events:
            try:
                raw = in_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got_input = True
            msg = decoder.decode(raw)
            if isinstance(msg, Shutdown):
                return
            _handle(core, msg, rejected)
        if os.getppid() != ppid:
            return  # the frontend is gone; nobody will read what we produce
        for notice in _NOTICES.take():
            out_sock.send(encoder.encode(notice))
        if _NOTICES.deadline is not None and time.time() >= _NOTICES.deadline:
            return  # the frontend had until the deadline to move our requests
        if not got_input and not core.has_unfinished_requests():
            continue
        num_steps = core.num_steps
        outputs = core.step()
        stats = core.stats()
        if step_delay_s and core.num_steps != num_steps:
            time.sleep(step_delay_s)
            slower = stats.last_step_seconds + step_delay_s
            stats = msgspec.structs.replace(stats, last_step_seconds=slower)
        wire = [output_to_wire(o) for o in outputs]
        rejected.extend(core.take_rejected())
        out_sock.send(encoder.encode(CoreOutputs(wire, stats, rejected, lora_state(core))))


def lora_state(core: EngineCore) -> WireLoRAState | None:
    cache = core.lora
    if cache is None:
        return None
    return WireLoRAState(list(cache.loaded), cache.stats.loads, cache.stats.evictions)


def _handle(core: EngineCore, msg: CoreInput, rejected: list[tuple[str, str]]) -> None:
    if isinstance(msg, AddRequest):
        try:
            core.add_request(
                Request(
                    msg.req_id,
                    msg.prompt_token_ids,
                    params_from_wire(msg.params),
                    eos_token_ids=tuple(msg.eos_token_ids),
                    priority=msg.priority,
                    group_id=msg.group_id,
                    output_token_ids=msg.output_token_ids,
                    lora_request=None if msg.lora is None else msg.lora.to_request(),
                )
            )
        except ValueError as e:
            rejected.append((msg.req_id, str(e)))
    elif isinstance(msg, AbortRequests):
        core.abort_requests(msg.req_ids)
    elif isinstance(msg, StopRequests):
        core.stop_requests(msg.req_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fleetserve EngineCore process")
    parser.add_argument("spec", help="EngineSpec as JSON")
    args = parser.parse_args(argv)
    spec = msgspec.json.decode(args.spec, type=EngineSpec)
    # Ctrl-C in a terminal reaches the whole process group; the frontend decides when we
    # stop (it drains first), so only SIGTERM or a Shutdown message ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _NOTICES.on_sigterm)
    code = run_core(spec)
    # Everything is shut down and flushed: skip the interpreter's final garbage collection
    # of the model (seconds on a loaded machine), which would keep a drained replica's
    # process, and its memory, around past the moment it was handed over.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
