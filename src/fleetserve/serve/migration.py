"""Request migration: the frontend's record of an in-flight request, and its move to
another replica when the one running it is lost.

A `MigratingStream` is what a generate service hands its callers for each engine request.
It keeps the request's prepared prompt and the last output its reader was given (the
prompt, every token and its text so far). When the replica's stream ends with
`ReplicaGoneError` (the engine process died, the replica is being drained for a spot
notice or a scale-down, or it hung), the stream asks its service for a new replica and
resubmits the request there with that output as `resume`: the new engine prefills
prompt + tokens so far (cheap where its prefix cache has the prompt) and samples on from
the next position, and its outputs continue the old ones. The reader sees one stream: no
token is repeated or dropped, `usage` counts the prompt once, and greedy or seeded streams
equal an undisturbed run (sampling is seeded by seed and output position).

Tokens the old replica produced that the reader had not taken yet are generated again;
for an unseeded sampled request they may then differ, which the reader cannot tell.

Hedging lives here too: with `hedge_after_s`, a request with no first output by then gets
a copy on another replica; the first of the two to produce an output wins and the other is
aborted, so the reader (and `usage`) sees one of them only.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError
from fleetserve.outputs import RequestOutput
from fleetserve.serve.base import ReplicaStreamLike, StreamObserver


def migration_reason(error: ReplicaGoneError) -> str:
    """The `reason` label of fleetserve:request_migrations_total for a lost replica."""
    text = str(error)
    for word, reason in (("drain", "drained"), ("stop", "stopped"), ("hung", "hung")):
        if word in text:
            return reason
    return "died"


class MigrationLimitError(EngineDeadError):
    """The request lost its replica more times than its `migration_limit` allows."""


class Resubmitter(Protocol):
    """The service side of migration (serve/model_service.py)."""

    async def resubmit(
        self, stream: MigratingStream, exclude: set[int]
    ) -> tuple[ReplicaStreamLike, int]:
        """The request on a new replica (not one of `exclude`), going on from
        `stream.last`; raises EngineDeadError when no replica can take it."""
        ...

    def on_migrated(self, stream: MigratingStream, error: ReplicaGoneError) -> None: ...


class MigratingStream:
    def __init__(
        self,
        service: Resubmitter,
        request_id: str,
        n: int,
        inner: ReplicaStreamLike,
        replica_index: int,
        *,
        observer: StreamObserver | None = None,
        migration_limit: int = 3,
        hedge_after_s: float | None = None,
        context: Any = None,
    ) -> None:
        self.service = service
        self.context = context  # what its service needs to resubmit it
        self.request_id = request_id
        self.n = n
        self.inner = inner
        self.replica_index = replica_index
        self.observer = observer
        self.migration_limit = migration_limit
        self.hedge_after_s = hedge_after_s
        self.last: RequestOutput | None = None  # the newest output its reader was given
        self.migrations = 0
        self.hedged = False
        self.replicas_used = [replica_index]
        self._ended = False
        self._closed = False

    def __aiter__(self) -> MigratingStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._closed or self._ended:
                raise StopAsyncIteration
            try:
                if self.last is None and self.hedge_after_s is not None and not self.hedged:
                    out = await self._first_hedged(self.hedge_after_s)
                else:
                    out = await self.inner.__anext__()
            except ReplicaGoneError as e:
                await self._migrate(e)
                continue
            except BaseException:
                self._end()
                raise
            self.last = out
            if self.observer is not None:
                self.observer.on_output(out)
            if out.finished:
                self._end()
            return out

    async def _migrate(self, error: ReplicaGoneError) -> None:
        self.inner.close()
        if self._closed:
            raise StopAsyncIteration
        if self.migrations >= self.migration_limit:
            self._end()
            raise MigrationLimitError(
                f"the request lost its replica {self.migrations + 1} times, more than its "
                f"migration_limit of {self.migration_limit}; last: {error}"
            ) from None
        self.migrations += 1
        self.service.on_migrated(self, error)
        try:
            self.inner, self.replica_index = await self.service.resubmit(
                self, exclude={self.replica_index}
            )
        except BaseException:
            self._end()
            raise
        self.replicas_used.append(self.replica_index)

    async def _first_hedged(self, after_s: float) -> RequestOutput:
        """The first output, from the first replica or, if that has none within `after_s`,
        from whichever of it and a copy on another replica answers first."""
        first = asyncio.ensure_future(self.inner.__anext__())
        try:
            done, _ = await asyncio.wait({first}, timeout=after_s)
            if done:
                return first.result()
            self.hedged = True
            copy, copy_index = await self.service.resubmit(self, exclude={self.replica_index})
        except EngineDeadError:
            return await first  # no other replica: keep waiting on the first
        except BaseException:
            first.cancel()
            raise
        second = asyncio.ensure_future(copy.__anext__())
        try:
            done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            first.cancel()
            second.cancel()
            copy.close()
            raise
        won_first = first in done and first.exception() is None
        winner, loser = (first, second) if won_first else (second, first)
        loser_stream = copy if won_first else self.inner
        if not won_first:
            self.inner, self.replica_index = copy, copy_index
            self.replicas_used.append(copy_index)
        loser.cancel()
        loser_stream.close()  # aborted in its engine: it is never billed
        return await winner

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            if self.observer is not None:
                self.observer.on_end()

    def close(self) -> None:
        self._closed = True
        self.inner.close()
        self._end()

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def started(self) -> bool:
        return self.last is not None
