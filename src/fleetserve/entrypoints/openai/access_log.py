"""Access log: one JSON line per HTTP request on the logger `fleetserve.access`, and the
request's id in the `X-Request-Id` response header.

The middleware owns what the HTTP exchange alone tells: the id, status and timings (at the
ASGI level, so a streamed response is timed to its last byte). Handlers attach what only
they know (model, class, response id, the states of the request's engine requests:
replicas, migrations, token counts, first token, error; serve/request_state.py) to the
`AccessRecord` they find with `access_record(request)`.

    {"time": "2026-12-03T17:42:25.120Z", "request_id": "9f0c...", "method": "POST",
     "path": "/v1/chat/completions", "status": 200, "model": "tiny", "class": "interactive",
     "response_id": "chatcmpl-...", "replicas": [0], "migrations": 0, "prompt_tokens": 12,
     "completion_tokens": 8, "ttft_s": 0.031, "duration_s": 0.112, "client": "127.0.0.1"}
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, Any

from fleetserve.serve.request_state import RequestState

REQUEST_ID_HEADER = "X-Request-Id"
ACCESS_LOG_MODES = ("json", "off")
logger = logging.getLogger("fleetserve.access")

# A client's own id is echoed into logs and headers, so only a plain token is taken;
# anything else (too long, spaces, quotes, control characters) gets an id of ours.
_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,127}")
_CLIENT_CLOSED = 499
_MAX_ERROR_CHARS = 300


@dataclass
class AccessRecord:
    """One request's line, filled by the middleware and the handler (owned by the request)."""

    request_id: str
    method: str
    path: str
    client: str | None
    start: float  # monotonic
    model: str | None = None
    class_name: str | None = None
    route: str | None = None  # the matched route's path template (a bounded label)
    response_id: str | None = None
    prompt_tokens: int | None = None  # given by handlers without streams (embeddings)
    metadata: dict[str, str] | None = None  # the request body's `metadata` (OpenAI's)
    states: list[RequestState] = field(default_factory=list)
    # A custom handler's calls to other models (fleet_client.SubCall), shown on this line.
    sub_calls: list[Any] = field(default_factory=list)
    status_of: Callable[[Exception], int] | None = None

    def watch(self, states: Sequence[RequestState], status_of: Callable[[Exception], int]) -> None:
        """The request's engine requests, whose states tell the line replicas, tokens,
        TTFT and errors; `status_of` maps the error a stream ends with to its status."""
        self.status_of = status_of
        self.states = list(states)

    def stream_error(self) -> Exception | None:
        return next((s.error for s in self.states if s.error is not None), None)

    def fields(self, status: int, end: float, client_gone: bool) -> dict[str, Any]:
        line: dict[str, Any] = {
            "time": _iso_now(),
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": status,
            "model": self.model,
            "class": self.class_name,
        }
        if self.response_id is not None:
            line["response_id"] = self.response_id
        if self.states:
            replicas: list[int] = []
            for s in self.states:
                # On Ray the router picks inside Serve: the state knows no index (< 0).
                replicas.extend(i for i in s.replicas_used if i >= 0 and i not in replicas)
            line["replicas"] = replicas
            line["migrations"] = sum(s.migrations for s in self.states)
            started = [s.fold for s in self.states if s.num_outputs]
            if started:
                line["prompt_tokens"] = sum(len(f.prompt_token_ids) for f in started)
                line["completion_tokens"] = sum(f.num_generated for f in started)
            firsts = [s.first_token_at for s in self.states if s.first_token_at is not None]
            line["ttft_s"] = round(min(firsts) - self.start, 6) if firsts else None
        elif self.prompt_tokens is not None:
            line["prompt_tokens"] = self.prompt_tokens
        if self.metadata:
            line["metadata"] = self.metadata
        if self.sub_calls:
            line["sub_calls"] = [
                {"model": c.model, "method": c.method, "status": c.status, "ms": round(c.ms, 1)}
                for c in self.sub_calls
            ]
        line["duration_s"] = round(end - self.start, 6)
        error = self.stream_error()
        if error is not None:
            line["error"] = str(error)[:_MAX_ERROR_CHARS]
            line["error_status"] = self.effective_status(status, client_gone)
        if client_gone:
            line["client_gone"] = True
        line["client"] = self.client
        return line

    def effective_status(self, status: int, client_gone: bool) -> int:
        """The status the request's outcome stands for: a stream that failed after its
        200 was sent counts as its error's status, a client that left as 499."""
        error = self.stream_error()
        if error is not None and self.status_of is not None:
            return self.status_of(error)
        if client_gone and status < 400:
            return _CLIENT_CLOSED
        return status


def access_record(request: Any) -> AccessRecord | None:
    """The record the middleware attached to this request (None outside the server)."""
    state = request.scope.get("state")
    record = state.get("access") if isinstance(state, dict) else None
    return record if isinstance(record, AccessRecord) else None


def note_model(request: Any, model: str, class_name: str | None = None) -> None:
    record = access_record(request)
    if record is not None:
        record.model, record.class_name = model, class_name
        route = request.scope.get("route")  # set by the router that matched the request
        record.route = getattr(route, "path", None)


def note_metadata(request: Any, metadata: dict[str, str] | None) -> None:
    """The request's `metadata` (OpenAI's field), written into its access line."""
    record = access_record(request)
    if record is not None and metadata:
        record.metadata = dict(metadata)


def note_prompt_tokens(request: Any, num_tokens: int) -> None:
    """For requests without streams (embeddings): the tokens they were billed for."""
    record = access_record(request)
    if record is not None:
        record.prompt_tokens = num_tokens


class AccessLogMiddleware:
    """Outermost ASGI middleware: gives every HTTP request an id (the client's
    X-Request-Id when it is a plain token), returns it in the response headers, and when
    the exchange ends writes the access line and calls `on_done(record, status)` (the
    server counts responses per model, class and status with it). Answers below 400 on
    `quiet_paths` (probes, /metrics scrapes, the dashboard's polls: one every second or
    so, with nothing to follow) are not logged; their errors are."""

    def __init__(
        self,
        app: Any,
        on_done: Callable[[AccessRecord, int], None] | None = None,
        quiet_paths: Iterable[str] = (),
        add_header: bool = True,
    ) -> None:
        self.app = app
        self.on_done = on_done
        self.quiet_paths = frozenset(quiet_paths)
        # False behind a proxy that returns the header itself (Ray Serve's: it passes
        # its id in, which is the one logged here).
        self.add_header = add_header

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        record = AccessRecord(
            _request_id(scope.get("headers", [])),
            scope["method"],
            scope["path"],
            client[0] if client else None,
            time.monotonic(),
        )
        scope.setdefault("state", {})["access"] = record
        header = (REQUEST_ID_HEADER.lower().encode(), record.request_id.encode())
        status: int | None = None
        body_done = raised = False

        async def send_with_id(message: Any) -> None:
            nonlocal status, body_done
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.add_header:
                    message = {**message, "headers": [*message.get("headers", []), header]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                body_done = True
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            raised = True
            raise
        finally:
            # No start line: the app raised before answering (uvicorn answers 500) or the
            # client left first; a started body that never ended: the client left.
            sent = status if status is not None else (500 if raised else _CLIENT_CLOSED)
            client_gone = status is not None and not body_done and not raised
            try:
                self._done(record, sent, client_gone)
            except Exception:  # noqa: BLE001 -- the answer is sent; a log bug must not fail it
                logging.getLogger("fleetserve.serve").exception("access log: line not written")

    def _done(self, record: AccessRecord, status: int, client_gone: bool) -> None:
        if self.on_done is not None:
            self.on_done(record, record.effective_status(status, client_gone))
        if record.path in self.quiet_paths and status < 400:
            return
        if logger.isEnabledFor(logging.INFO):
            line = record.fields(status, time.monotonic(), client_gone)
            logger.info(json.dumps(line, ensure_ascii=False, separators=(",", ":")))


def _request_id(headers: Sequence[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _SANE_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


def _iso_now() -> str:
    now = datetime.now(timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


def configure_access_log(mode: str, stream: IO[str] | None = None) -> None:
    """`--access-log json` (default): one JSON line per request to stdout, whatever
    --log-level says; `off`: none."""
    if mode not in ACCESS_LOG_MODES:
        raise ValueError(f"--access-log must be one of {', '.join(ACCESS_LOG_MODES)}, got {mode!r}")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.propagate = False
    if mode == "off":
        logger.setLevel(logging.CRITICAL + 1)
        return
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
