"""One request's stream from a pod (serve/remote/replica.py), and reading a pod's error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from fleetserve.engine.delta_stream import DeltaStream


class RemoteStream(DeltaStream):
    """One request's deltas from a pod (as the pod's frames carry them); same iteration,
    `fail` and `close()` as the local engine's RequestStream. Closing it before it
    finishes closes its HTTP stream, which aborts it on the pod."""

    def __init__(self, release: Callable[[RemoteStream], None], request_id: str, n: int) -> None:
        super().__init__(request_id, n, release)  # type: ignore[arg-type]
        self.task: asyncio.Task[None] | None = None


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
