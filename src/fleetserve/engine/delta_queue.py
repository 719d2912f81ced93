"""One request's deltas between the task that receives them and its reader.

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

from fleetserve.outputs import RequestOutput, merge_delta


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
