"""What a LocalReplica needs of its engine client: the AsyncEngine of a local engine-core
process, or serve/remote/replica.py's RemoteEngine of another fleetserve server over HTTP. The
replica's load accounting, seats, drain and eviction are written once against this."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from fleetserve.config import EngineConfig
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.outputs import RequestOutput


class EngineStream(Protocol):
    """One request's cumulative outputs (a slow reader skips to the newest); an exception
    put on `queue` ends it with that error (ReplicaGoneError: it goes on elsewhere)."""

    request_id: str
    n: int
    queue: asyncio.Queue[Any]
    finished: bool
    closed: bool

    def __aiter__(self) -> EngineStream: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    """Called on the event loop thread only. `add_request` validates and sends without
    blocking (ValueError, EngineDeadError, EngineNotReadyError, EngineOverloadedError)."""

    config: EngineConfig
    num_kv_blocks: int | None
    dead_reason: str | None
    crashed: bool
    on_stats: Callable[[dict[str, float]], None] | None
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
    ) -> EngineStream: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self, reason: str) -> None: ...

    def kill(self) -> None: ...

    async def shutdown(self, timeout_s: float = 10.0) -> None: ...
