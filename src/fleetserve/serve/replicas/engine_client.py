"""What a LocalReplica needs of its engine client: the AsyncEngine of a local engine-core
process, or serve/remote/replica.py's RemoteEngine of another fleetserve server over HTTP. The
replica's load accounting, seats, drain and eviction are written once against this."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fleetserve.config import EngineConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.delta_stream import DeltaStream
from fleetserve.engine.stats import EngineStats
from fleetserve.outputs import RequestOutput

# One request's deltas from an engine client: both clients hand out a DeltaStream (the
# local engine's RequestStream, a pod's RemoteStream).
EngineStream = DeltaStream


class EngineClient(Protocol):
    """Called on the event loop thread only. `add_request` validates and sends without
    blocking (ValueError, EngineDeadError, EngineNotReadyError, EngineOverloadedError)."""

    config: EngineConfig
    num_kv_blocks: int | None
    dead_reason: str | None
    crashed: bool
    # The LoRA adapters its engine holds in memory (as it last reported them).
    lora_loaded: frozenset[str]
    on_stats: Callable[[EngineStats], None] | None
    on_notice: Callable[[Any], None] | None

    @property
    def is_ready(self) -> bool: ...

    @property
    def core_pid(self) -> int | None: ...

    async def start(self, timeout_s: float = 600.0) -> None: ...

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        priority: int = 0,
        resume: RequestOutput | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineStream: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self, reason: str) -> None: ...

    def kill(self) -> None: ...

    async def shutdown(self, timeout_s: float = 10.0) -> None: ...
