"""The hedging race (serve/resilience/hedging.py) over scripted replica streams of deltas: no copy while the
first call answers in time; the first answer wins and the other call is closed (aborted
in its engine) and never read; a call that fails does not win while the other may still
answer; no copy when none can be made. The same race on real engines: test_resume.py
(local) and test_ray_resilience.py (Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError
from fleetserve.metrics import ServerMetrics
from fleetserve.outputs import CompletionOutput, OutputFold, RequestOutput
from fleetserve.serve.contracts import ReplicaStreamLike
from fleetserve.serve.request_state import FleetStream, RequestState
from fleetserve.serve.resilience.hedging import Hedge, hedge_for

MAX_TOKENS = 3


def output(num_tokens: int, tag: int) -> RequestOutput:
    """The delta that brings the answer to `num_tokens` tokens; `tag` tells the calls apart."""
    ids = [tag + num_tokens - 1]
    done = num_tokens == MAX_TOKENS
    choice = CompletionOutput(0, str(ids), ids, "length" if done else None)
    return RequestOutput("req-0", "p", [1, 2], [choice], finished=done)


def answer(stream: FleetStream) -> list[int]:
    """The whole answer its state folded from the deltas its reader got."""
    return stream.state.fold.output().outputs[0].token_ids


class Call:
    """One call's stream: waits `delay_s` before its first output (or raises `fail`)."""

    def __init__(self, tag: int, delay_s: float, fail: BaseException | None = None) -> None:
        self.tag, self.delay_s, self.fail = tag, delay_s, fail
        self.request_id, self.n = "req-0", 1
        self.num_read = 0
        self.closed = False

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.num_read == 0:
            await asyncio.sleep(self.delay_s)
            if self.fail is not None:
                raise self.fail
        if self.num_read == MAX_TOKENS or self.closed:
            raise StopAsyncIteration
        self.num_read += 1
        return output(self.num_read, self.tag)

    def close(self) -> None:
        self.closed = True


class Service:
    """Resubmitter and CopyMaker: the copy is `copy_call` on replica 1."""

    def __init__(self, copy_call: Call | None) -> None:
        self.copy_call = copy_call
        self.copies: list[set[int]] = []

    async def make_copy(self, stream: Any, exclude: set[int]) -> tuple[ReplicaStreamLike, int]:
        self.copies.append(exclude)
        if self.copy_call is None:
            raise EngineDeadError("no other replica")
        return self.copy_call, 1

    async def resubmit(self, stream: Any, exclude: set[int]) -> tuple[ReplicaStreamLike, int]:
        raise AssertionError("nothing is lost in these races")

    def on_migrated(self, stream: Any, error: ReplicaGoneError) -> None:
        raise AssertionError("nothing is lost in these races")


def read(first: Call, copy: Call | None, after_s: float = 0.05) -> tuple[Any, Any, Any]:
    """(outputs read, the stream, the model's metrics) of one hedged request."""
    metrics = ServerMetrics().model("m")
    service = Service(copy)
    hedge = hedge_for(after_s, service.make_copy, metrics)
    state = RequestState("req-0", 1, "c", 0, 0.0, OutputFold("req-0"), 0)
    stream = FleetStream(state, first, service, hedge=hedge)

    async def main() -> list[RequestOutput]:
        return [out async for out in stream]

    got = asyncio.run(asyncio.wait_for(main(), 10))
    return got, stream, (service, metrics)


def hedges(metrics: Any, winner: str) -> float:
    return metrics.server.hedges.labels("m", winner)._value.get()  # type: ignore[no-any-return]


def test_a_first_answer_in_time_sends_no_copy() -> None:
    first, copy = Call(100, 0.0), Call(200, 0.0)
    got, stream, (service, metrics) = read(first, copy, after_s=5.0)
    assert got[-1] == output(MAX_TOKENS, 100)
    assert not stream.state.hedged and service.copies == [] and copy.num_read == 0
    assert answer(stream) == [100, 101, 102]
    assert hedges(metrics, "first") == hedges(metrics, "copy") == 0


def test_the_copy_wins_when_the_first_is_slow_and_the_first_is_closed() -> None:
    first, copy = Call(100, 1.0), Call(200, 0.0)
    got, stream, (service, metrics) = read(first, copy)
    # One stream: every output from the copy, none from the first (usage counts one).
    assert got == [output(k, 200) for k in range(1, MAX_TOKENS + 1)]
    assert service.copies == [{0}]  # never on the first call's replica
    assert first.closed and first.num_read == 0
    assert stream.state.hedged and stream.inner is copy and stream.state.replica_index == 1
    assert stream.state.replicas_used == [0, 1] and answer(stream) == [200, 201, 202]
    assert hedges(metrics, "copy") == 1 and hedges(metrics, "first") == 0


def test_the_first_wins_when_it_answers_before_the_copy() -> None:
    first, copy = Call(100, 0.2), Call(200, 2.0)
    got, stream, (_, metrics) = read(first, copy)
    assert got == [output(k, 100) for k in range(1, MAX_TOKENS + 1)]
    assert copy.closed and copy.num_read == 0
    assert stream.state.hedged and stream.inner is first and stream.state.replicas_used == [0]
    assert hedges(metrics, "first") == 1 and hedges(metrics, "copy") == 0


@pytest.mark.parametrize("failing", ["copy", "first"])
def test_a_call_that_fails_does_not_win_while_the_other_may_answer(failing: str) -> None:
    gone = ReplicaGoneError("the replica hung")
    if failing == "copy":
        first, copy = Call(100, 0.4), Call(200, 0.0, fail=gone)
    else:
        first, copy = Call(100, 0.1, fail=gone), Call(200, 0.3)
    got, stream, (_, metrics) = read(first, copy)
    winner = first if failing == "copy" else copy
    assert got[-1] == output(MAX_TOKENS, winner.tag)
    assert stream.inner is winner
    assert (
        hedges(metrics, failing) == 0
        and hedges(metrics, "first" if winner is first else "copy") == 1
    )


def test_with_no_replica_for_a_copy_the_first_runs_alone() -> None:
    first = Call(100, 0.2)
    got, stream, (service, metrics) = read(first, None)
    assert got[-1] == output(MAX_TOKENS, 100)
    assert service.copies == [{0}] and stream.state.hedged and stream.inner is first
    assert hedges(metrics, "first") == hedges(metrics, "copy") == 0


def test_hedge_after_s_must_be_positive() -> None:
    async def make_copy(stream: Any, exclude: set[int]) -> Any:
        raise AssertionError

    assert hedge_for(None, make_copy, None) is None
    with pytest.raises(ValueError, match="hedge_after_s"):
        Hedge(0.0, make_copy)
