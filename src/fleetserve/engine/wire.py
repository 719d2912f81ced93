"""The messages between an API process and its EngineCore process (one schema, both sides).

    frontend PUSH --(AddRequest | AbortRequests | StopRequests | Shutdown)--> core PULL
    frontend PULL <--(CoreReady | CoreOutputs | CoreFailure)------------------ core PUSH

Every message is msgpack via msgspec structs with explicit fields (never pickle). The
sampling settings travel as `WireSamplingParams`, a struct built from SamplingParams'
own field list (core/sampling_params.SAMPLING_FIELDS), so no field list is copied here.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING

import msgspec

from fleetserve.cloud.notices import NoticeConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SAMPLING_FIELDS, SamplingParams
from fleetserve.core.scheduler_output import EngineCoreOutput
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.stats import EngineStats

_HINTS = typing.get_type_hints(SamplingParams)

# Array-like: a field is a position, so both sides must run the same fleetserve version
# (they do: the core process is spawned from the frontend's interpreter).
if TYPE_CHECKING:

    class WireSamplingParams(msgspec.Struct, array_like=True):
        """SamplingParams' SAMPLING_FIELDS as a struct (built below, at import)."""

else:
    WireSamplingParams = msgspec.defstruct(
        "WireSamplingParams",
        [(name, _HINTS[name]) for name in SAMPLING_FIELDS],
        array_like=True,
        module=__name__,
    )


def params_to_wire(p: SamplingParams) -> WireSamplingParams:
    return WireSamplingParams(**{name: getattr(p, name) for name in SAMPLING_FIELDS})


def params_from_wire(w: WireSamplingParams) -> SamplingParams:
    return SamplingParams(**{name: getattr(w, name) for name in SAMPLING_FIELDS})


class WireLoRA(msgspec.Struct, array_like=True):
    """A request's LoRA adapter (core/lora_request.LoRARequest)."""

    name: str
    int_id: int
    path: str

    def to_request(self) -> LoRARequest:
        return LoRARequest(self.name, self.int_id, self.path)

    @classmethod
    def of(cls, lora: LoRARequest | None) -> WireLoRA | None:
        return None if lora is None else cls(lora.lora_name, lora.lora_int_id, lora.lora_path)


class WireLoRAState(msgspec.Struct, array_like=True):
    """The core's adapters: those loaded now (what routing prefers), and per name the
    loads and evictions since start (counters)."""

    loaded: list[str]
    loads: dict[str, int]
    evictions: dict[str, int]


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    eos_token_ids: list[int]
    # Lower runs first under the "priority" scheduling policy (the fleet's class priority
    # and the request's own priority folded into one number, see serve/admission/sla.py).
    priority: int = 0
    group_id: str | None = None
    # Tokens it already generated on a replica that was lost (request migration).
    output_token_ids: list[int] = []
    # The LoRA adapter it runs with (None: the base model); kept across migration.
    lora: WireLoRA | None = None


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
    stats: EngineStats
    # Requests the core refused (req_id, reason); their ids are unknown to the core.
    rejected: list[tuple[str, str]] = []
    # Engines with LoRA on: their adapters (None: LoRA off).
    lora: WireLoRAState | None = None


class CoreFailure(msgspec.Struct, tag="failure", array_like=True):
    message: str


class CoreNotice(msgspec.Struct, tag="notice", array_like=True):
    """The core's machine or process will be taken away (SIGTERM, a cloud's spot
    preemption notice): the frontend should drain it by `deadline` (time.time())."""

    source: str
    deadline: float
    detail: str = ""
    # The cloud's id of the event where it has one (Azure's EventId: what
    # cloud/notices.py's acknowledge() sends back to let the eviction go ahead).
    event_id: str | None = None


CoreMessage = CoreReady | CoreOutputs | CoreFailure | CoreNotice


class EngineSpec(msgspec.Struct):
    """What the frontend tells a new core process (JSON on its command line)."""

    engine_args: EngineArgs
    input_address: str
    output_address: str
    parent_pid: int
    data_parallel_rank: int = 0
    # After SIGTERM the core keeps serving for this long while the frontend moves its
    # requests elsewhere, then exits by itself (a second SIGTERM ends it at once).
    sigterm_grace_s: float = 15.0
    # A cloud's spot notice source (a spot pool's `notice:`), polled in the core process.
    notice: NoticeConfig | None = None
