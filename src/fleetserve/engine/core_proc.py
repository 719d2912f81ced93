"""The EngineCore process: its step loop, its ZeroMQ sockets and the wire format.

The API process binds two ipc:// sockets; this process connects to them:

    frontend PUSH --(AddRequest | AbortRequests | StopRequests | Shutdown)--> core PULL
    frontend PULL <--(CoreReady | CoreOutputs | CoreFailure)------------------ core PUSH

Every message is msgpack via msgspec structs with explicit fields (never pickle). The loop
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
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler_output import EngineCoreOutput

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


# ------------------------------------------------------------------ wire format
class WireSamplingParams(msgspec.Struct, array_like=True):
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool
    include_stop_str_in_output: bool


def params_to_wire(p: SamplingParams) -> WireSamplingParams:
    return WireSamplingParams(
        n=p.n,
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        top_k=p.top_k,
        min_p=float(p.min_p),
        repetition_penalty=float(p.repetition_penalty),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        seed=p.seed,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        stop=list(p.stop_strings),
        stop_token_ids=list(p.stop_token_ids or []),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
    )


def params_from_wire(w: WireSamplingParams) -> SamplingParams:
    return SamplingParams(**{f: getattr(w, f) for f in w.__struct_fields__})


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    eos_token_ids: list[int]
    priority: int = 0
    group_id: str | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    req_ids: list[str]


class StopRequests(msgspec.Struct, tag="stop", array_like=True):
    req_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequest | AbortRequests | StopRequests | Shutdown


class WireOutput(msgspec.Struct, array_like=True):
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    new_prompt_logprobs: list[dict[int, float] | None] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int

    def to_core_output(self) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=self.req_id,
            new_token_ids=self.new_token_ids,
            new_logprobs=self.new_logprobs,
            new_prompt_logprobs=self.new_prompt_logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=self.num_cached_tokens,
        )


def output_to_wire(o: EngineCoreOutput) -> WireOutput:
    return WireOutput(
        o.req_id,
        o.new_token_ids,
        o.new_logprobs,
        o.new_prompt_logprobs,
        o.finish_reason,
        o.stop_reason,
        o.num_cached_tokens,
    )


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    num_kv_blocks: int
    block_size: int
    max_model_len: int


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[WireOutput]
    stats: dict[str, float]
    # Requests the core refused (req_id, reason); their ids are unknown to the core.
    rejected: list[tuple[str, str]] = []


class CoreFailure(msgspec.Struct, tag="failure", array_like=True):
    message: str


CoreMessage = CoreReady | CoreOutputs | CoreFailure


class EngineSpec(msgspec.Struct):
    """What the frontend tells a new core process (JSON on its command line)."""

    engine_args: dict[str, Any]
    input_address: str
    output_address: str
    parent_pid: int
    data_parallel_rank: int = 0


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
