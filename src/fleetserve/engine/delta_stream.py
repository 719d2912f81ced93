"""One request's deltas between the task that receives them and its reader: the
`DeltaQueue`, and the `DeltaStream` every engine client hands out (AsyncEngine's, and
serve/remote's for a pod).

A reader that falls behind is not skipped ahead (deltas cannot be skipped, unlike the
cumulative outputs of old) and is not handed a backlog either: `put` merges a delta into
the one still waiting (outputs.merge_delta), so `get` always returns everything the
reader has not had, as one delta. Like vLLM v1's RequestOutputCollector.

An error (`fail`) ends the request for its reader: `get` first returns what was put
before it, then raises it (ReplicaGoneError: the fleet goes on from exactly what the
reader got). Deltas put after an error are dropped. Event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from fleetserve.outputs import RequestOutput, merge_delta


class EngineDeadError(RuntimeError):
    """The core process is gone; no request can be served any more."""


class ReplicaGoneError(EngineDeadError):
    """This engine can no longer serve the request (its process died, it is being drained
    or stopped), though another replica may: the fleet resumes the request elsewhere
    (request migration, serve/resilience/migration.py)."""


class ReplicaRefusedError(ReplicaGoneError):
    """The replica refused the request before starting it (it is draining): the request
    goes elsewhere, but nothing of it was lost, so it is not a migration (it does not use
    up a move of its migration_limit)."""


class DeltaQueue:
    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, delta: RequestOutput) -> None:
        """`delta` is the queue's from now on (it may be merged into in place)."""
        if self._error is not None:
            return
        if self._pending is None:
            self._pending = delta
        else:
            merge_delta(self._pending, delta)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Ends the stream with `error` after what was put so far (the first error wins)."""
        if self._error is None:
            self._error = error
            self._ready.set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    async def get(self) -> RequestOutput:
        while self._pending is None and self._error is None:
            await self._ready.wait()
            self._ready.clear()
        out = self._pending
        if out is None:
            assert self._error is not None
            raise self._error
        self._pending = None
        if self._error is None:
            self._ready.clear()
        return out


class StreamListener(Protocol):
    """Told of one engine stream's deltas as its reader takes them, and of its end (a
    replica's load accounting: serve/replicas/local.py)."""

    def on_delta(self, delta: RequestOutput) -> None: ...

    def on_end(self) -> None:
        """The stream ended (finished, failed or closed); called once."""
        ...


class DeltaStream:
    """One request's deltas from one engine client (the local engine's RequestStream, a
    pod's RemoteStream): iterate it for the deltas; `fail(error)` ends it with `error`
    after what it holds; `close()` ends it, calling `release` (which aborts the request
    where it runs if it has not finished). `listener` hears every delta and the end."""

    def __init__(self, request_id: str, n: int, release: Callable[[DeltaStream], None]) -> None:
        self.request_id = request_id
        self.n = n
        self.deltas = DeltaQueue()
        self.listener: StreamListener | None = None
        self.started = False  # the first delta arrived
        self.finished = False
        self.closed = False
        self.lost = False  # ended by ReplicaGoneError: the request goes on elsewhere
        self._release = release
        self._ended = False

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            delta = await self.deltas.get()
        except Exception as e:
            self.lost = isinstance(e, ReplicaGoneError)
            self.close()
            raise
        if delta.finished:
            self.finished = True
        if self.listener is not None:
            self.listener.on_delta(delta)
        if self.finished:
            self._end()
        return delta

    def fail(self, error: BaseException) -> None:
        self.deltas.fail(error)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._release(self)
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            if self.listener is not None:
                self.listener.on_end()
