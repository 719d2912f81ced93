"""One request's stream from a pod (serve/remote/replica.py), and reading a pod's error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from fleetserve.outputs import RequestOutput


class RemoteStream:
    """One request's outputs from a pod; same iteration and `close()` as RequestStream.
    Closing it before it finishes closes its HTTP stream, which aborts it on the pod."""

    def __init__(self, release: Callable[[RemoteStream], None], request_id: str, n: int) -> None:
        self._release = release
        self.request_id = request_id
        self.n = n
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.started = False
        self.finished = False
        self.closed = False
        self.task: asyncio.Task[None] | None = None

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not self.queue.empty() and not isinstance(item, BaseException):
            item = self.queue.get_nowait()  # cumulative: only the newest matters
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._release(self)


def error_body(raw: bytes) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        body = json.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body["error"]  # type: ignore[no-any-return]
    return {}


def error_message(raw: bytes) -> str:
    return str(error_body(raw).get("message") or raw[:200].decode("utf-8", "replace"))


def error_code(raw: bytes) -> str | None:
    code = error_body(raw).get("code")
    return code if isinstance(code, str) else None
