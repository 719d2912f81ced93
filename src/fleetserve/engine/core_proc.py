"""The EngineCore process: its step loop and its ZeroMQ sockets.

The API process binds two ipc:// sockets; this process connects to them and speaks the
messages of engine/wire.py (msgpack via msgspec structs, never pickle). The loop
drains its input without blocking between steps while requests run, blocks on input when
idle, reports engine stats after every step, and exits when the frontend says so, when it
gets SIGTERM, or when its parent process is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec

from fleetserve.core.request import Request
from fleetserve.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreFailure,
    CoreInput,
    CoreOutputs,
    CoreReady,
    EngineSpec,
    Shutdown,
    StopRequests,
    output_to_wire,
    params_from_wire,
)

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


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def run_core(spec: EngineSpec) -> int:
    import zmq

    from fleetserve.engine.arg_utils import EngineArgs
    from fleetserve.engine.core import EngineCore

    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 1000)
    out_sock.connect(spec.output_address)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(spec.input_address)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(CoreInput)  # type: ignore[arg-type]
    core = None
    try:
        try:
            step_delay_s = debug_step_delay_s(
                os.environ.get(DEBUG_STEP_DELAY_ENV), spec.data_parallel_rank
            )
            config, source = EngineArgs(**spec.engine_args).resolve()
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
        if core is not None:
            core.shutdown()
        in_sock.close(0)
        out_sock.close(1000)
        ctx.term()


def _loop(
    core: Any,
    in_sock: Any,
    out_sock: Any,
    encoder: Any,
    decoder: Any,
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
        if not got_input and not core.has_unfinished_requests():
            continue
        num_steps = core.num_steps
        outputs = core.step()
        stats = core.stats()
        if step_delay_s and core.num_steps != num_steps:
            time.sleep(step_delay_s)
            stats["last_step_seconds"] += step_delay_s
        wire = [output_to_wire(o) for o in outputs]
        out_sock.send(encoder.encode(CoreOutputs(wire, stats, rejected)))


def _handle(core: Any, msg: CoreInput, rejected: list[tuple[str, str]]) -> None:
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
    signal.signal(signal.SIGTERM, _on_sigterm)
    return run_core(spec)


if __name__ == "__main__":
    sys.exit(main())
