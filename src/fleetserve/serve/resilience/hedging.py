"""Hedging: a request of a class with `hedge_after_s` that has no first output by then gets
a copy on another replica; the first of the two to produce an output wins and the other
is aborted in its engine, so the reader (and `usage`, counted from the outputs it reads)
sees one of them only.

The race is written once, here, for every transport: a `Hedge` carries the delay and the
service's `CopyMaker`, which knows its replicas (the local service's router picks another
replica at once; the Ray ingress calls its deployment again, never on the replica the
first call went to: ray/clients.py). A FleetStream (serve/request_state.py) runs the race
for its first output only; after that it is an ordinary stream, moved if its replica is
lost.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fleetserve.engine.async_engine import EngineDeadError
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import RequestOutput
from fleetserve.serve.contracts import ReplicaStreamLike

if TYPE_CHECKING:
    from fleetserve.serve.request_state import FleetStream


class CopyMaker(Protocol):
    async def __call__(
        self, stream: FleetStream, exclude: set[int]
    ) -> tuple[ReplicaStreamLike, int]:
        """A copy of `stream`'s request, from its start, on a replica that is not one of
        `exclude` nor the one its first call went to; (the copy's stream, its replica
        index). Raises EngineDeadError when no replica can take a copy now: the first
        call then runs alone (waiting for a replica would only delay its answer)."""
        ...


@dataclass(frozen=True)
class Hedge:
    """A class's hedging, as its service applies it. `metrics` counts the races by winner
    (fleetserve:request_hedges{winner="first"|"copy"})."""

    after_s: float
    make_copy: CopyMaker
    metrics: ModelMetrics | None = None

    def __post_init__(self) -> None:
        if not self.after_s > 0:
            raise ValueError(f"hedge_after_s must be > 0, got {self.after_s}")


async def first_output(stream: FleetStream, hedge: Hedge) -> RequestOutput:
    """`stream`'s first output: from its current call, or, if that has none within
    `hedge.after_s`, from whichever of it and a copy answers first. The loser is aborted;
    if the copy wins, `stream` goes on with it (its `inner`, its state's replica). A call that
    fails does not win while the other may still answer; if both fail, the first call's
    error is raised (a lost replica's ReplicaGoneError: the stream then moves it)."""
    first = asyncio.ensure_future(stream.inner.__anext__())
    try:
        done, _ = await asyncio.wait({first}, timeout=hedge.after_s)
    except BaseException:
        first.cancel()
        raise
    if done:
        return first.result()
    state = stream.state
    state.hedged = True
    try:
        copy, copy_index = await hedge.make_copy(stream, {state.replica_index})
    except EngineDeadError:
        return await first  # no replica for a copy: the first call alone
    except BaseException:
        first.cancel()
        raise
    second = asyncio.ensure_future(copy.__anext__())
    racing = {first, second}
    try:
        while True:
            done, racing = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            answered = [t for t in (first, second) if t.done() and t.exception() is None]
            if answered or not racing:
                break
    except BaseException:
        first.cancel()
        second.cancel()
        copy.close()
        raise
    winner = answered[0] if answered else first
    if winner is second:
        loser, loser_stream = first, stream.inner
        stream.inner = copy
        state.moved_to(copy_index)
    else:
        loser, loser_stream = second, copy
    loser.cancel()
    loser_stream.close()  # aborted in its engine: it is never billed
    if hedge.metrics is not None and answered:
        hedge.metrics.add_hedge("copy" if winner is second else "first")
    return winner.result()


def hedge_for(
    after_s: float | None, make_copy: CopyMaker, metrics: ModelMetrics | None
) -> Hedge | None:
    """A class's Hedge (None: the class does not hedge, `hedge_after_s` unset)."""
    return None if after_s is None else Hedge(after_s, make_copy, metrics)
