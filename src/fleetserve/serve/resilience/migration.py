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

With a `hedge` (serve/resilience/hedging.py), a request with no first output by its `after_s` gets
a copy on another replica; the first of the two to produce an output wins and the other is
aborted, so the reader (and `usage`) sees one of them only.
"""

from __future__ import annotations

from typing import Any, Protocol

from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError
from fleetserve.outputs import RequestOutput
from fleetserve.serve.contracts import ReplicaStreamLike, StreamObserver
from fleetserve.serve.resilience.hedging import Hedge, first_output


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
    """The service side of migration (serve/services/generate.py)."""

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
        hedge: Hedge | None = None,
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
        self.hedge = hedge
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
                if self.last is None and self.hedge is not None and not self.hedged:
                    out = await first_output(self, self.hedge)
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
