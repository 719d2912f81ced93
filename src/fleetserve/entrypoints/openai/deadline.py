"""A request's own deadline: the header `X-Fleetserve-Deadline-Ms: N` asks for the answer
within N milliseconds of the request's arrival at the server.

Admission and the running request honour it: the wait in the class queue and the work
after it (`unless_disconnected` in serving_common.py, which every non-streaming answer and
every admission goes through) are bounded by what is left of it, and a stream stops at it
(`bounded_sse`). Past it the client gets a 504 with the OpenAI error body (code
"deadline_exceeded"; in a stream whose 200 has gone out, the error chunk) and the engine
requests are aborted; nothing else in flight is touched. A cascade's tiers and a graph's
steps run one after another inside the one deadline, so each gets only what the ones
before it left. Without the header a request has no deadline of its own (its class's
max_queue_time_s and a graph's timeout_s still apply).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fleetserve.entrypoints.openai.errors import APIError, error_body

DEADLINE_HEADER = "X-Fleetserve-Deadline-Ms"
_KEY = "fleetserve.deadline"  # in the request's ASGI scope: (deadline, budget_ms) or None
MAX_DEADLINE_MS = 24 * 3600 * 1000.0


class DeadlineExceeded(APIError):
    """The request's deadline passed: 504, code "deadline_exceeded"."""

    def __init__(self, budget_ms: float, during: str = "") -> None:
        where = f" during {during}" if during else ""
        super().__init__(
            504,
            f"the request's deadline ({DEADLINE_HEADER}: {budget_ms:g}) passed{where}; "
            "its work was stopped",
            None,
            "deadline_exceeded",
        )


def _start(request: Any) -> float:
    """When the request arrived: its access record's start, else now."""
    from fleetserve.entrypoints.openai.access_log import access_record

    record = access_record(request)
    return record.start if record is not None else time.monotonic()


def parse_deadline_ms(raw: str) -> float:
    """The header's value in ms; ValueError-free: a bad value is a 400 naming the header."""
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not (0 < ms <= MAX_DEADLINE_MS):
        raise APIError(
            400,
            f"{DEADLINE_HEADER} must be a number of milliseconds in (0, {MAX_DEADLINE_MS:g}], "
            f"got {raw[:40]!r}",
            DEADLINE_HEADER,
        )
    return ms


def deadline_of(request: Any) -> tuple[float, float] | None:
    """(the monotonic time the request must end by, its budget in ms), or None without the
    header. Read once per request (400 for a bad value)."""
    scope = request.scope
    if _KEY in scope:
        cached: tuple[float, float] | None = scope[_KEY]
        return cached
    raw = request.headers.get(DEADLINE_HEADER)
    value = None
    if raw is not None:
        ms = parse_deadline_ms(raw)
        value = (_start(request) + ms / 1e3, ms)
    scope[_KEY] = value
    return value


def deadline_time(request: Any) -> float | None:
    """The monotonic time the request must end by (None: no deadline of its own)."""
    d = deadline_of(request)
    return None if d is None else d[0]


def remaining_s(request: Any) -> float | None:
    """Seconds left of the request's deadline (None: none); <= 0 once it has passed."""
    d = deadline_of(request)
    return None if d is None else d[0] - time.monotonic()


def exceeded(request: Any, during: str = "") -> DeadlineExceeded:
    d = deadline_of(request)
    return DeadlineExceeded(d[1] if d is not None else 0.0, during)


async def bounded_sse(request: Any, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's SSE chunks until the request's deadline; past it, the 504 error chunk and
    [DONE], and the inner generator is closed (its cleanup aborts the engine requests)."""
    from fleetserve.entrypoints.openai.serving_common import SSE_DONE, sse

    try:
        while True:
            left = remaining_s(request)
            try:
                if left is None:
                    chunk = await chunks.__anext__()
                elif left <= 0:
                    raise TimeoutError
                else:
                    # not wait_for: in Python 3.11 it can swallow a cancel that arrives
                    # as the chunk does (fleet_client._bounded)
                    async with asyncio.timeout(left):
                        chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                err = exceeded(request, "the stream")
                yield sse(error_body(err.status, err.message, err.param, err.code))
                yield SSE_DONE
                return
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def with_deadline(request: Any, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """`chunks` bounded by the request's deadline; as they are when it has none (no extra
    hop per chunk)."""
    return chunks if deadline_of(request) is None else bounded_sse(request, chunks)
