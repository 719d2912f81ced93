"""Reading a request body safely: media type, size, time, JSON, and text that can be encoded.

Everything here runs before a request is validated or counted anywhere, so a body that
fails these checks leaves no trace in the server's state.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from fleetserve import cpu_work
from fleetserve.core.sampling_params import is_valid_unicode
from fleetserve.entrypoints.openai.errors import APIError

JSON_MEDIA_TYPE = "application/json"


class ClientGone(Exception):
    """The client went away; nobody is left to answer."""


def check_json_media_type(request: Request) -> None:
    """415 unless the body is declared as JSON. Browsers send text/plain and form bodies
    cross-site without a CORS preflight; refusing them keeps any web page a user visits
    from driving a local server."""
    declared = request.headers.get("content-type", "")
    media_type, *params = (part.strip() for part in declared.split(";"))
    shown = repr(declared[:80]) if declared else "none"
    if media_type.lower() != JSON_MEDIA_TYPE:
        raise APIError(
            415,
            f"Content-Type must be {JSON_MEDIA_TYPE} (got {shown})",
            code="unsupported_media_type",
        )
    for param in params:
        key, _, value = param.partition("=")
        # JSON is UTF-8 (RFC 8259): a body declared in another charset would be misread.
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise APIError(
                415,
                f"a JSON body must be UTF-8: charset={value.strip()[:40]!r} is not supported "
                f"(got {shown})",
                code="unsupported_media_type",
            )


async def read_json(request: Request, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object whose every string is valid Unicode.

    415 if not declared as JSON, 413 past max_bytes, 408 if the body takes longer than
    timeout_s to arrive, 400 if it is not a JSON object or holds text that cannot be
    encoded (lone UTF-16 surrogates); ClientGone if the client disconnects meanwhile.
    """
    check_json_media_type(request)
    raw = await read_bytes(request, max_bytes, timeout_s)
    if len(raw) > cpu_work.SMALL:  # a large body is parsed off the event loop
        return await cpu_work.run_cpu(parse_json_object, raw)
    return parse_json_object(raw)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object whose every string is valid Unicode; APIError 400 if not."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    bad = unencodable_path(body)
    if bad is not None:
        raise APIError(
            400,
            f"{bad or 'the body'} holds text that is not valid Unicode (a lone UTF-16 "
            "surrogate such as \\ud800); send well-formed UTF-8",
            bad or None,
        )
    return body


async def read_bytes(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body: 413 past max_bytes, 408 if it takes longer than timeout_s to arrive;
    ClientGone if the client disconnects meanwhile."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is larger than {max_bytes} bytes")
    try:
        return await asyncio.wait_for(_read_bounded(request, max_bytes), timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        raise ClientGone() from None


async def _read_bounded(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def unencodable_path(value: Any) -> str | None:
    """The dotted path (`messages.0.content`, `stop.1`) of the first string, key or value,
    that UTF-8 cannot encode; '' for the top level; None when all text is fine.

    Iterative, so a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not is_valid_unicode(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                name = (
                    key
                    if is_valid_unicode(key)
                    else key.encode("utf-8", "backslashreplace").decode()
                )
                child_path = f"{path}.{name}" if path else name
                if not is_valid_unicode(key):
                    return child_path
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
    return None
