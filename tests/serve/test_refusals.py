"""A replica's refusal before it starts a request (a draining Ray replica) sends the
request elsewhere without using up a move of its migration_limit; a lost replica still
does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetserve.engine.delta_stream import ReplicaGoneError, ReplicaRefusedError
from fleetserve.outputs import CompletionOutput, OutputFold, RequestOutput
from fleetserve.serve.request_state import FleetStream, RequestState
from fleetserve.serve.resilience.migration import (
    MAX_REFUSALS,
    MigrationLimitError,
)


def _final() -> RequestOutput:
    return RequestOutput("r", "p", [1], [CompletionOutput(0, "x", [5], "stop")], finished=True)


class Call:
    """One call: raises `error`, or answers with the final output."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.closed = False

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.error is not None:
            raise self.error
        return _final()

    def close(self) -> None:
        self.closed = True


class Service:
    """Resubmits each call as the next of `calls`."""

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.migrated: list[Exception] = []

    async def resubmit(self, stream: Any, exclude: set[int]) -> tuple[Call, int]:
        return self.calls.pop(0), len(self.calls)

    def on_migrated(self, stream: Any, error: Exception) -> None:
        self.migrated.append(error)


def _read(first: Call, rest: list[Call], limit: int) -> tuple[RequestState, Service]:
    service = Service(rest)
    state = RequestState("r", 1, "c", 0, 0.0, OutputFold("r"), 0)
    stream = FleetStream(state, first, service, migration_limit=limit)  # type: ignore[arg-type]

    async def main() -> None:
        assert (await stream.__anext__()).finished

    asyncio.run(main())
    return state, service


def test_a_refusal_is_not_a_migration() -> None:
    refused = ReplicaRefusedError("the replica is draining")
    stream, service = _read(Call(refused), [Call(refused), Call(None)], limit=0)
    assert stream.migrations == 0 and stream.refusals == 2 and service.migrated == []


def test_a_lost_replica_still_uses_a_move() -> None:
    with pytest.raises(MigrationLimitError):
        _read(Call(ReplicaGoneError("the engine died")), [Call(None)], limit=0)
    stream, service = _read(Call(ReplicaGoneError("the engine died")), [Call(None)], limit=1)
    assert stream.migrations == 1 and len(service.migrated) == 1


def test_refusals_without_end_count_as_moves_past_a_bound() -> None:
    refused = ReplicaRefusedError("the replica is draining")
    calls = [Call(refused) for _ in range(MAX_REFUSALS + 5)]
    with pytest.raises(MigrationLimitError):
        _read(Call(refused), calls, limit=2)
