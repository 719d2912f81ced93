"""One engine request in the frontend: its `RequestState`, and the `FleetStream` its
reader iterates.

The state is the one record of a request from the moment it is sent to a replica until
it ends: its ids and class, the replica(s) it ran on, how often it moved, its answer so
far (the fold of every delta its reader got, which is what a move resumes from), and what
the access log reports (first token, the error it ended with). Migration and hedging
(serve/resilience/) and the access log read and update this one object; nothing else
keeps a copy.

The stream reads the deltas of the request's current call on a replica (an engine
client's DeltaStream, a Ray call's RayStream) and hands them on as they are: no wrapper
per concern, no cumulative copy. For each delta it updates the state and tells its
observer (latencies by class); when the replica is lost (ReplicaGoneError) it moves the
request (serve/resilience/migration.py); before the first delta of a hedged class it
races a copy (serve/resilience/hedging.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fleetserve.engine.async_engine import ReplicaGoneError
from fleetserve.outputs import OutputFold, RequestOutput
from fleetserve.serve.contracts import ReplicaStreamLike, StreamObserver
from fleetserve.serve.resilience.hedging import Hedge, first_output
from fleetserve.serve.resilience.migration import Resubmitter, migrate


@dataclass
class RequestState:
    """Owned by its FleetStream (event loop thread). `replica_index` < 0: not known (on
    Ray, Serve's router places each call). `fold` starts from `resume` for a request a
    gateway moved here, so it is always the whole answer its client has."""

    request_id: str
    n: int
    class_name: str
    priority: int  # the engine's (class and request folded: serve/admission/sla.py)
    arrival: float  # time.monotonic() when it reached its service
    fold: OutputFold
    replica_index: int
    replicas_used: list[int] = field(default_factory=list)
    queue_deadline: float | None = None  # when it would have been shed had it not started
    migrations: int = 0
    refusals: int = 0  # calls refused before they started (not migrations)
    hedged: bool = False
    num_outputs: int = 0  # deltas its reader got on this server
    first_token_at: float | None = None  # time.monotonic() of its first token
    error: Exception | None = None  # what its stream ended with
    ended: bool = False

    def __post_init__(self) -> None:
        if not self.replicas_used:
            self.replicas_used.append(self.replica_index)

    @property
    def finished(self) -> bool:
        return self.fold.finished

    def add(self, delta: RequestOutput) -> None:
        """Its reader got `delta`."""
        self.fold.add(delta)
        self.num_outputs += 1
        if self.first_token_at is None and any(c.token_ids for c in delta.outputs):
            self.first_token_at = time.monotonic()

    def moved_to(self, replica_index: int) -> None:
        self.replica_index = replica_index
        self.replicas_used.append(replica_index)

    def resume_from(self) -> RequestOutput | None:
        """What a new call goes on from: the whole answer so far (None: nothing yet)."""
        return self.fold.output() if self.fold.num_generated else None


class FleetStream:
    """The stream a service hands its callers for one engine request (one prompt):
    iterate it for deltas; `close()` aborts the request where it runs. `context` is what
    its service needs to resubmit it (serve/resilience/resubmit.py, ray/clients.py)."""

    def __init__(
        self,
        state: RequestState,
        inner: ReplicaStreamLike,
        service: Resubmitter,
        *,
        observer: StreamObserver | None = None,
        migration_limit: int = 3,
        hedge: Hedge | None = None,
        context: Any = None,
    ) -> None:
        self.state = state
        self.inner = inner
        self.service = service
        self.observer = observer
        self.migration_limit = migration_limit
        self.hedge = hedge
        self.context = context
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def n(self) -> int:
        return self.state.n

    @property
    def closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> FleetStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self._next()
        except StopAsyncIteration:
            raise
        except Exception as e:
            self.state.error = e
            raise

    async def _next(self) -> RequestOutput:
        state = self.state
        while True:
            if self._closed or state.ended:
                raise StopAsyncIteration
            try:
                if state.num_outputs == 0 and self.hedge is not None and not state.hedged:
                    delta = await first_output(self, self.hedge)
                else:
                    delta = await self.inner.__anext__()
            except ReplicaGoneError as e:
                self.inner.close()
                if self._closed:
                    raise StopAsyncIteration from None
                try:
                    await migrate(self, e)
                except BaseException:
                    self._end()
                    raise
                continue
            except BaseException:
                self._end()
                raise
            state.add(delta)
            if self.observer is not None:
                self.observer.on_output(delta, state)
            if delta.finished:
                self._end()
            return delta

    def _end(self) -> None:
        if not self.state.ended:
            self.state.ended = True
            if self.observer is not None:
                self.observer.on_end()

    def close(self) -> None:
        self._closed = True
        self.inner.close()
        self._end()
