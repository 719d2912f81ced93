"""The fleet client's streaming variants (GatewayFleetClient.chat_stream / complete_stream):
the same chunks the HTTP endpoint streams, as dicts, produced by the endpoint's own stream
writer over the callee's service (its class queue, routing, migration, metrics). The
parent's deadline bounds the whole stream (a chunk not there in time: FleetCallError 504);
closing the iterator early, or cancelling the parent, ends the stream and aborts its engine
requests. An error the endpoint would send in the stream is raised as FleetCallError."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fleetserve.entrypoints.openai.serving_common import SSE_DONE

if TYPE_CHECKING:
    from fleetserve.entrypoints.openai.fleet_client import GatewayFleetClient

_STATUS = {s.phrase.lower(): s.value for s in HTTPStatus}


async def stream_chunks(
    client: GatewayFleetClient, model: str, method: str, sse: AsyncIterator[str]
) -> AsyncIterator[dict[str, Any]]:
    """Each SSE event of `sse` as a dict, bounded by `client`'s deadline, recorded in its
    `calls` when the stream ends."""
    from fleetserve.entrypoints.openai.fleet_client import FleetCallError, SubCall

    it = sse.__aiter__()
    start = time.monotonic()
    status = 499  # ended before its end: closed early or cancelled

    async def next_event() -> str | None:
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return None

    try:
        while True:
            event = await client._bounded(model, method, next_event(), record=False)
            if event is None or event == SSE_DONE:
                status = 200
                return
            body = json.loads(event.removeprefix("data: "))
            if "error" in body and "choices" not in body:
                err = body["error"]
                status = _STATUS.get(str(err.get("code")), 500)
                raise FleetCallError(status, str(err.get("message")))
            yield body
    except FleetCallError as e:
        status = e.status
        raise
    finally:
        client.calls.append(SubCall(model, method, status, (time.monotonic() - start) * 1e3))
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()
