"""The HTTP schema between a gateway and the fleetserve servers it routes over (pods).

    gateway --POST /internal/v1/replica/generate  GenerateRequest (msgpack or JSON)-->  pod
    gateway <--200, a stream of frames: u32 big-endian length + msgpack OutputFrame|ErrorFrame
    gateway --GET /internal/v1/replica/load?model=M -----------------> LoadReport (JSON)

The work is already tokenized (the gateway tokenizes once); `resume` is the request's last
output the gateway's reader got from a replica that was lost (request migration), so the
pod goes on from there. Outputs travel as deltas, as everywhere else in fleetserve: the
pod's engine yields deltas, `FrameWriter` puts each in a frame as it is, and the gateway's
`FrameReader` turns each frame back into the delta the serve layer reads; nothing is
folded or diffed on the way. Frames are msgpack because logprobs may be -inf, which JSON
cannot carry.
"""

from __future__ import annotations

import struct
import typing
from typing import Annotated, Any

import msgspec

from fleetserve.core.sampling_params import SAMPLING_FIELDS, SamplingParams
from fleetserve.outputs import CompletionOutput, Logprobs, RequestOutput

GENERATE_PATH = "/internal/v1/replica/generate"
LOAD_PATH = "/internal/v1/replica/load"
MSGPACK = "application/msgpack"
FRAMES = "application/x-fleetserve-frames"
_HINTS = typing.get_type_hints(SamplingParams)
_LEN = struct.Struct(">I")
_MAX_FRAME = 64 << 20

# SamplingParams' fields by name (one definition: core/sampling_params.SAMPLING_FIELDS);
# unlike the engine's positional wire struct, a pod may run another fleetserve version.
_DEFAULTS = SamplingParams()
HttpSamplingParams = msgspec.defstruct(
    "HttpSamplingParams",
    [(name, _HINTS[name], getattr(_DEFAULTS, name)) for name in SAMPLING_FIELDS],
    forbid_unknown_fields=True,
    module=__name__,
)


def params_to_http(p: SamplingParams) -> Any:
    return HttpSamplingParams(**{name: getattr(p, name) for name in SAMPLING_FIELDS})


def params_from_http(w: Any) -> SamplingParams:
    """ValueError naming the field when a value is out of range."""
    return SamplingParams(**{name: getattr(w, name) for name in SAMPLING_FIELDS})


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    prompt_token_ids: Annotated[list[int], msgspec.Meta(min_length=1)]
    params: HttpSamplingParams  # type: ignore[valid-type]
    prompt: str | None = None
    # The engine priority (serve/sla.engine_priority: class priority * 2^32 + the
    # request's own); the pod queues it in its class of that priority.
    priority: int = 0
    resume: RequestOutput | None = None


class ChoiceDelta(msgspec.Struct, omit_defaults=True):
    """One choice's delta (outputs.py): what is new since the request's last frame."""

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # set in the one frame that ends the choice
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


class OutputFrame(msgspec.Struct, tag="output", omit_defaults=True):
    choices: list[ChoiceDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None  # once, in the frame that has them
    metrics: dict[str, float] = {}


class ErrorFrame(msgspec.Struct, tag="error"):
    """The request failed on the pod; `retry_elsewhere`: another replica may serve it."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    retry_elsewhere: bool = False


Frame = OutputFrame | ErrorFrame


class LoadReport(msgspec.Struct):
    """One model of a pod, as its gateway's router sees it."""

    model: str
    healthy: bool  # takes requests now
    draining: bool  # shutting down (SIGTERM): take requests elsewhere
    drain_left_s: float | None
    dead_reason: str | None
    num_replicas: int
    num_outstanding_requests: int
    num_outstanding_tokens: int
    queue_depth: int  # not started: in its class queues and its engines' schedulers
    num_requests_running: int
    kv_cache_usage_perc: float
    kv_capacity_tokens: int | None
    max_num_seqs: int
    step_latency_s: float | None
    num_steps: int
    prefix_cache_hit_rate: float
    # The LoRA adapters its engines hold (loaded or in their CPU caches): the gateway
    # routes an adapter's requests to the pods that hold it. A pod without it: none.
    lora_adapters: list[str] = []


def check_resume(
    resume: RequestOutput, prompt_ids: list[int], params: SamplingParams, vocab: int
) -> None:
    """ValueError naming the field unless `resume` can be the start of this request."""
    if resume.prompt_token_ids != prompt_ids:
        raise ValueError("resume.prompt_token_ids must equal prompt_token_ids")
    if len(resume.outputs) != params.n:
        raise ValueError(f"resume.outputs has {len(resume.outputs)} entries for n={params.n}")
    for i, c in enumerate(resume.outputs):
        if c.index != i:
            raise ValueError(f"resume.outputs[{i}].index must be {i}, got {c.index}")
        if any(not 0 <= t < vocab for t in c.token_ids):
            raise ValueError(f"resume.outputs[{i}].token_ids must be in [0, {vocab})")
        if c.logprobs is not None and len(c.logprobs) != len(c.token_ids):
            raise ValueError(f"resume.outputs[{i}].logprobs must have one entry per token")
        limit = params.max_tokens
        if c.finish_reason is None and limit is not None and len(c.token_ids) >= limit:
            raise ValueError(f"resume.outputs[{i}] has max_tokens={limit} tokens but no end")
        if c.finish_reason not in (None, "stop", "length", "abort"):
            raise ValueError(f"resume.outputs[{i}].finish_reason {c.finish_reason!r} is unknown")
    if all(c.finished for c in resume.outputs):
        raise ValueError("resume: every output has finished; nothing is left to generate")


def frame_bytes(frame: Frame, encoder: msgspec.msgpack.Encoder) -> bytes:
    body = encoder.encode(frame)
    return _LEN.pack(len(body)) + body


class FrameWriter:
    """The pod's side: the request's deltas in, frames out."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def output(self, out: RequestOutput) -> bytes:
        choices = [
            ChoiceDelta(
                c.index,
                c.token_ids,
                c.text,
                c.logprobs,
                c.finish_reason,
                c.stop_reason,
                c.cumulative_logprob,
            )  # fmt: skip
            for c in out.outputs
        ]
        frame = OutputFrame(choices, out.finished, out.num_cached_tokens, out.prompt_logprobs,
                            out.metrics)  # fmt: skip
        return frame_bytes(frame, self._encoder)

    def error(self, frame: ErrorFrame) -> bytes:
        return frame_bytes(frame, self._encoder)


class FrameReader:
    """The gateway's side: bytes in, frames out (`feed`), and each OutputFrame as the
    delta it carries (`delta`)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int]) -> None:
        self._decoder = msgspec.msgpack.Decoder(Frame)  # type: ignore[arg-type]
        self._buf = bytearray()
        self._request_id, self._prompt, self._prompt_ids = request_id, prompt, prompt_ids

    def feed(self, data: bytes) -> list[Frame]:
        """The frames `data` completes; msgspec.DecodeError / ValueError on a bad stream."""
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if size > _MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes is past the {_MAX_FRAME} limit")
            if len(self._buf) < _LEN.size + size:
                break
            frames.append(self._decoder.decode(bytes(self._buf[_LEN.size : _LEN.size + size])))
            del self._buf[: _LEN.size + size]
        return frames

    def delta(self, frame: OutputFrame) -> RequestOutput:
        choices = [
            CompletionOutput(
                d.index,
                d.text,
                d.token_ids,
                d.finish_reason,
                d.stop_reason,
                d.logprobs,
                d.cumulative_logprob,
            )  # fmt: skip
            for d in frame.choices
        ]
        return RequestOutput(self._request_id, self._prompt, self._prompt_ids, choices,
                             frame.finished, frame.prompt_logprobs, frame.num_cached_tokens,
                             frame.metrics)  # fmt: skip
