"""The fleet client inside a custom model's handler process: each method sends
("fleet", (call_id, method, args, kwargs)) up the handler's pipe and awaits the parent's
("fleet_reply", (call_id, ok, body_or_message)); the parent runs the call through its
ModelServices (entrypoints/openai/fleet_client.py). Several sub-calls may be in flight at
once (asyncio.gather in an async handler): one reader at a time takes the replies off the
pipe; anything else it reads (the parent's next message) is kept for the main loop."""

from __future__ import annotations

import asyncio
import itertools
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
        self._pending: dict[int, asyncio.Future[Any]] = {}
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

    async def _call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        self._conn.send(("fleet", (call_id, method, args, kwargs)))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        ok, value = await fut
        if not ok:
            status, message = value
            raise FleetCallError(status, message)
        return value  # type: ignore[no-any-return]

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            kind, payload = await loop.run_in_executor(None, self._conn.recv)
            if kind != "fleet_reply":
                self.kept.append((kind, payload))
                continue
            call_id, ok, value = payload
            fut = self._pending.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_result((ok, value))
