"""The fleet client inside a custom model's handler process: each method sends
("fleet", (call_id, method, args, kwargs)) up the handler's pipe and awaits the parent's
("fleet_reply", (call_id, ok, body_or_message)); the parent runs the call through its
ModelServices (entrypoints/openai/fleet_client.py). Several sub-calls may be in flight at
once (asyncio.gather in an async handler): one reader at a time takes the replies off the
pipe; anything else it reads (the parent's next message) is kept for the main loop.

The streaming variants (chat_stream, complete_stream) get several replies for one call:
(call_id, True, ("chunk", chunk_dict)) per chunk, then (call_id, True, ("end", None)), or
(call_id, False, (status, message)). The reader drains the pipe into each call's queue
whether or not the handler reads it (so the server never blocks on a full pipe); a handler
that stops reading (closes the iterator, or drops it) sends ("fleet_cancel", call_id) and
the parent ends the stream, aborting its engine requests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any


class FleetCallError(RuntimeError):
    """A sub-call failed; `status` is the HTTP status the endpoint would have answered."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ProcFleetClient:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Queue[tuple[bool, Any]]] = {}
        # Calls sent whose last reply has not come yet (streams: until "end" or an error).
        self._open: set[int] = set()
        self._streams: set[int] = set()
        self._settled: asyncio.Event | None = None
        self._reader: asyncio.Task[None] | None = None
        self.kept: list[tuple[str, Any]] = []  # messages for the main loop

    async def chat(
        self, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> dict[str, Any]:
        return await self._call("chat", [model, messages], params)

    async def complete(self, model: str, prompt: Any, **params: Any) -> dict[str, Any]:
        return await self._call("complete", [model, prompt], params)

    async def embed(self, model: str, inputs: Any, **params: Any) -> dict[str, Any]:
        return await self._call("embed", [model, inputs], params)

    async def predict(self, model: str, instances: list[dict[str, Any]]) -> dict[str, Any]:
        return await self._call("predict", [model, instances], {})

    def chat_stream(
        self, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """The chat.completion.chunk dicts the endpoint would stream."""
        return self._stream("chat_stream", [model, messages], params)

    def complete_stream(
        self, model: str, prompt: Any, **params: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """The text_completion chunk dicts the endpoint would stream."""
        return self._stream("complete_stream", [model, prompt], params)

    def _send(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[int, Any]:
        call_id = next(self._ids)
        queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        self._pending[call_id] = queue
        self._open.add(call_id)
        if method.endswith("_stream"):
            self._streams.add(call_id)
        self._conn.send(("fleet", (call_id, method, args, kwargs)))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        return call_id, queue

    async def _call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        call_id, queue = self._send(method, args, kwargs)
        try:
            ok, value = await queue.get()
        finally:
            self._pending.pop(call_id, None)
        if not ok:
            status, message = value
            raise FleetCallError(status, message)
        return value  # type: ignore[no-any-return]

    async def _stream(
        self, method: str, args: list[Any], kwargs: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        call_id, queue = self._send(method, args, kwargs)
        ended = False
        try:
            while True:
                ok, value = await queue.get()
                if not ok:
                    ended = True
                    status, message = value
                    raise FleetCallError(status, message)
                kind, chunk = value
                if kind == "end":
                    ended = True
                    return
                yield chunk
        finally:
            self._pending.pop(call_id, None)
            if not ended:  # the handler stopped reading: the parent ends the stream
                with contextlib.suppress(OSError, ValueError):  # the parent is gone
                    self._conn.send(("fleet_cancel", call_id))

    @property
    def open_calls(self) -> int:
        return len(self._open)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """After the handler's call: every sub-call it left running is cancelled and its
        last reply read, so that no reader is left on the pipe the next call uses."""
        if not self._open:
            return
        for call_id in list(self._open):
            try:
                self._conn.send(("fleet_cancel", call_id))
            except (OSError, ValueError):
                return
        self._settled = asyncio.Event()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait_for(self._settled.wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            self._settled = None

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while self._open:
            kind, payload = await loop.run_in_executor(None, self._conn.recv)
            if kind != "fleet_reply":
                self.kept.append((kind, payload))
                continue
            call_id, ok, value = payload
            if not ok or call_id not in self._streams or value[0] == "end":
                self._open.discard(call_id)
                self._streams.discard(call_id)
            queue = self._pending.get(call_id)
            if queue is not None:
                queue.put_nowait((ok, value))
        if self._settled is not None:
            self._settled.set()
