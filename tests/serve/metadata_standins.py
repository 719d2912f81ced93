"""Local stand-ins for the clouds' instance metadata services, for the notice watchers.

AWS IMDSv2, GCP's metadata server and Azure Scheduled Events cannot be reached from here
(they live on link-local addresses inside each cloud's VMs), so these HTTP servers on
127.0.0.1 (ephemeral port, one thread per request) answer the paths the watchers use in the
formats and with the headers the clouds document (see fleetserve/cloud/notices.py for the
URLs), including the refusals: IMDSv2 answers 401 to a GET without a valid session token and
400 to a token PUT without a TTL, GCP answers 403 without `Metadata-Flavor: Google`, Azure
answers 400 without `Metadata: true` or with an unknown api-version. Each has a switch to
"preempt now". Use them as context managers.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.server.standin.handle(self, "GET")

    def do_PUT(self) -> None:
        self.server.standin.handle(self, "PUT")

    def do_POST(self) -> None:
        self.server.standin.handle(self, "POST")

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "text/plain",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    standin: _StandIn


class _StandIn:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.num_requests = 0
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.standin = self
        # A short poll interval: shutdown() waits for it, once per test.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> _StandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def handle(self, req: _Handler, method: str) -> None:
        with self.lock:
            self.num_requests += 1
            self.route(req, method, urlsplit(req.path))

    def route(self, req: _Handler, method: str, path: Any) -> None:
        raise NotImplementedError


class AwsImdsStandIn(_StandIn):
    """IMDSv2 with tokens required (`HttpTokens: required`), plus the spot instance-action."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.tokens: dict[str, float] = {}  # token -> expiry (clock seconds)
        self.instance_action: dict[str, str] | None = None
        self.num_token_puts = 0
        self.num_unauthorized = 0

    def __enter__(self) -> AwsImdsStandIn:
        super().__enter__()
        return self

    def preempt_in(self, seconds: float, action: str = "terminate") -> float:
        """Schedule an interruption; returns its time (whole seconds, as IMDS writes it)."""
        at = int(self.clock() + seconds)
        with self.lock:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
            self.instance_action = {"action": action, "time": when}
        return float(at)

    def revoke_tokens(self) -> None:
        """Forget every token, as IMDS does when the instance is stopped and started."""
        with self.lock:
            self.tokens.clear()

    def route(self, req: _Handler, method: str, path: Any) -> None:
        if method == "PUT" and path.path == "/latest/api/token":
            ttl = req.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return req.answer(400)
            token = secrets.token_urlsafe(32)
            self.tokens[token] = self.clock() + int(ttl)
            self.num_token_puts += 1
            ttl_header = {"X-aws-ec2-metadata-token-ttl-seconds": ttl}
            return req.answer(200, token.encode(), headers=ttl_header)
        if method != "GET":
            return req.answer(405)
        presented = req.headers.get("X-aws-ec2-metadata-token")
        if presented is None or self.tokens.get(presented, 0.0) <= self.clock():
            self.num_unauthorized += 1
            return req.answer(401)
        if path.path == "/latest/meta-data/spot/instance-action" and self.instance_action:
            return req.answer(200, json.dumps(self.instance_action).encode())
        return req.answer(404)


class GcpMetadataStandIn(_StandIn):
    """The metadata server's `instance/preempted` key. `flavor_header=False` makes it answer
    without the `Metadata-Flavor: Google` header, as something that is not the metadata
    server (a proxy, a captive portal) would."""

    def __init__(self, flavor_header: bool = True) -> None:
        super().__init__()
        self.flavor_header = flavor_header
        self.preempted = False

    def __enter__(self) -> GcpMetadataStandIn:
        super().__enter__()
        return self

    def preempt(self) -> None:
        """Flip `preempted` to TRUE; the VM is stopped 30 s later (GCP gives no timestamp)."""
        with self.lock:
            self.preempted = True

    def route(self, req: _Handler, method: str, path: Any) -> None:
        flavor = {"Metadata-Flavor": "Google"} if self.flavor_header else {}
        if req.headers.get("Metadata-Flavor") != "Google" or "X-Forwarded-For" in req.headers:
            return req.answer(403, b"Missing Metadata-Flavor:Google header.", headers=flavor)
        if method != "GET":
            return req.answer(405, headers=flavor)
        if path.path != "/computeMetadata/v1/instance/preempted":
            return req.answer(404, headers=flavor)
        body = b"TRUE" if self.preempted else b"FALSE"
        return req.answer(200, body, "application/text", headers=flavor)


class AzureScheduledEventsStandIn(_StandIn):
    """Scheduled Events at api-version 2020-07-01: a document of events, and StartRequests
    acknowledgements that move an event to Started (with a blank NotBefore)."""

    API_VERSIONS = ("2020-07-01",)

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        self.acknowledged: list[str] = []

    def __enter__(self) -> AzureScheduledEventsStandIn:
        super().__enter__()
        return self

    def add_event(
        self,
        event_type: str,
        resources: list[str],
        not_before_in_s: float | None = 30.0,
        status: str = "Scheduled",
    ) -> str:
        """Schedule an event; returns its EventId. `not_before_in_s=None` leaves NotBefore
        blank, as Azure does once an event has started."""
        not_before = ""
        if not_before_in_s is not None:
            not_before = formatdate(int(self.clock() + not_before_in_s), usegmt=True)
        event_id = str(uuid.uuid4()).upper()
        event = {
            "EventId": event_id,
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": list(resources),
            "EventStatus": status,
            "NotBefore": not_before,
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }
        with self.lock:
            self.events.append(event)
            self.incarnation += 1
        return event_id

    def preempt_in(self, seconds: float, resources: list[str]) -> str:
        return self.add_event("Preempt", resources, seconds)

    def route(self, req: _Handler, method: str, path: Any) -> None:
        if req.headers.get("Metadata") != "true":
            error = {"error": "Bad request. Required metadata header not specified"}
            return req.answer(400, json.dumps(error).encode(), "application/json")
        if path.path != "/metadata/scheduledevents":
            return req.answer(404)
        version = parse_qs(path.query).get("api-version", [""])[0]
        if version not in self.API_VERSIONS:
            error = {"error": "Bad request. api-version is invalid or was not specified"}
            return req.answer(400, json.dumps(error).encode(), "application/json")
        if method == "GET":
            doc = {"DocumentIncarnation": self.incarnation, "Events": self.events}
            return req.answer(200, json.dumps(doc).encode(), "application/json")
        if method != "POST":
            return req.answer(405)
        try:
            starts = json.loads(req.body())["StartRequests"]
            ids = [start["EventId"] for start in starts]
        except (ValueError, KeyError, TypeError):
            return req.answer(400)
        for event in self.events:
            if event["EventId"] in ids:
                event["EventStatus"], event["NotBefore"] = "Started", ""
        self.acknowledged.extend(ids)
        self.incarnation += 1
        return req.answer(200)
