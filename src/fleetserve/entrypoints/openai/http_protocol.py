"""uvicorn's h11 protocol with two front-door fixes.

- Headers must arrive in time: a connection that has not sent a complete request head
  within `header_timeout_s` of connecting (or of starting its next request on a kept-alive
  connection) gets a 408 and is closed. Without this a client that trickles header bytes
  holds a connection (and the server's shutdown) for ever; the body is bounded by the
  handlers' own read timeout.
- Requests h11 cannot parse (a malformed Content-Length, a bad request line) get the OpenAI
  error body as JSON instead of uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fleetserve.entrypoints.openai.errors import error_body


def _json_response(conn: h11.Connection, status: int, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    out = conn.send(h11.Response(status_code=status, headers=headers))
    out += conn.send(h11.Data(data=body))
    out += conn.send(h11.EndOfMessage())
    return out


class FrontDoorH11Protocol(H11Protocol):
    header_timeout_s: float = 15.0  # set by `with_header_timeout`

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[FrontDoorH11Protocol]:
        return type("FrontDoorH11Protocol", (cls,), {"header_timeout_s": seconds})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            # A request head is still incomplete: it must complete in time.
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # Idle between requests is the keep-alive timer's business, not ours.
        self._disarm_header_timer()
        super().on_response_complete()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:
            message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
            with contextlib.suppress(h11.LocalProtocolError):
                self.transport.write(_json_response(self.conn, 408, message, "request_timeout"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        try:
            out = _json_response(self.conn, 400, f"malformed HTTP request: {msg}", "bad_request")
        except h11.LocalProtocolError:
            self.transport.close()
            return
        self.transport.write(out)
        self.transport.close()
