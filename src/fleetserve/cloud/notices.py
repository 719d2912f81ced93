"""Spot-preemption notices from the clouds' instance metadata services.

A watcher does one check per `poll()` and answers a `PreemptionNotice` (when the machine
goes away) or None. It never raises on network trouble: a metadata service that is slow,
absent (not on that cloud) or answering nonsense gives None, and the reason is kept in
`last_error` for the log. `NoticeThread` polls a watcher until the first notice and hands it
to a callback once; the engine-core process uses that to start its replica's drain.

The protocols, as the clouds document them:

- AWS, IMDSv2: `PUT /latest/api/token` (header `X-aws-ec2-metadata-token-ttl-seconds`) gives
  a session token; `GET /latest/meta-data/spot/instance-action` with header
  `X-aws-ec2-metadata-token` is 404 until an interruption is scheduled, then 200 with
  `{"action": "terminate"|"stop"|"hibernate", "time": "2017-09-18T08:22:00Z"}`. An expired
  or unknown token is answered 401.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
- GCP: `GET /computeMetadata/v1/instance/preempted` with header `Metadata-Flavor: Google`
  answers `TRUE` or `FALSE`, and the metadata server marks its answers with the same header.
  A Spot VM gets 30 s between the notice and the stop.
  https://cloud.google.com/compute/docs/instances/create-use-spot (detect preemption)
  https://cloud.google.com/compute/docs/instances/spot (preemption process)
  https://cloud.google.com/compute/docs/metadata/querying-metadata
- Azure Scheduled Events: `GET /metadata/scheduledevents?api-version=2020-07-01` with header
  `Metadata: true` answers `{"DocumentIncarnation": n, "Events": [...]}`; an eviction of a
  Spot VM is an event of `EventType` `Preempt` (minimum notice 30 s) whose `NotBefore` is an
  RFC 1123 date, blank once the event has started. `POST` of
  `{"StartRequests": [{"EventId": id}]}` tells Azure it may go ahead now.
  https://learn.microsoft.com/en-us/azure/virtual-machines/linux/scheduled-events

The requests go straight to the metadata address with http.client: the environment's HTTP
proxy must not see them (Azure's docs ask clients to bypass proxies for IMDS).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Annotated, ClassVar, Literal, Protocol, get_args
from urllib.parse import urlsplit

from annotated_types import Gt, Le
from pydantic import Strict

logger = logging.getLogger(__name__)

Provider = Literal["aws", "gcp", "azure"]
DEFAULT_URLS: dict[str, str] = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
# One check must not hold the poll loop (or a stop()) for long; the services answer in ms.
HTTP_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 1 << 16
AWS_TOKEN_TTL_S = 21600
# Refresh the IMDSv2 token this long before it expires, so no check races its expiry.
AWS_TOKEN_REFRESH_MARGIN_S = 60.0
GCP_NOTICE_S = 30.0
AZURE_PREEMPT_NOTICE_S = 30.0
AZURE_API_VERSION = "2020-07-01"


@dataclass(frozen=True)
class PreemptionNotice:
    provider: str
    deadline: float  # time.time() epoch seconds when the machine goes away
    detail: str
    # The cloud's id of the event, where it has one (Azure's EventId, for acknowledge()).
    event_id: str | None = None


@dataclass(frozen=True)
class NoticeConfig:
    """What to watch: a spot pool's `notice:` in the fleet file, carried to the engine-core
    process as it is. GCP and Azure give 30 s from notice to stop, and a GCP deadline counts
    from the poll that saw it, so keep `poll_interval_s` to a few seconds (AWS itself
    suggests polling every 5 s).

    The one definition for both readers: the fleet file's parser (pydantic reads the
    annotations below, so a wrong key or type is named by its path, and `__post_init__`'s
    rules then apply) and direct construction (`__post_init__` alone)."""

    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    provider: Provider
    url: str | None = None  # base URL http(s)://host[:port]; None = the documented address
    poll_interval_s: Annotated[float, Strict(), Gt(0.0), Le(60.0)] = 1.0
    # Azure only: a Preempt event counts only if this VM name is among its Resources.
    resource_name: str | None = None

    def __post_init__(self) -> None:
        if self.provider not in get_args(Provider):
            raise ValueError(
                f"provider must be one of {list(get_args(Provider))}, got {self.provider!r}"
            )
        if self.url is not None:
            _split_base_url(self.url)
        interval = self.poll_interval_s
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not (math.isfinite(interval) and 0.0 < interval <= 60.0)
        ):
            raise ValueError(f"poll_interval_s must be in (0, 60] seconds, got {interval!r}")
        if self.resource_name is not None and (
            self.provider != "azure"
            or not isinstance(self.resource_name, str)
            or not self.resource_name
        ):
            raise ValueError(
                "resource_name is a non-empty VM name and applies to provider 'azure' only, "
                f"got {self.resource_name!r} for provider {self.provider!r}"
            )

    @property
    def base_url(self) -> str:
        return (self.url or DEFAULT_URLS[self.provider]).rstrip("/")


def _split_base_url(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of an `http(s)://host[:port]` URL, else ValueError naming url."""
    problem = f"url {url!r}: expected http://host[:port] or https://host[:port], no path"
    if not isinstance(url, str):
        raise ValueError(problem)
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(problem) from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(problem)
    return parts.scheme, parts.hostname, port


class NoticeWatcher(Protocol):
    """One cloud's notice source. `poll` is one check and never raises on network or
    protocol trouble (it answers None and sets `last_error`); once a notice was seen, later
    polls keep answering it with the same deadline. Not thread-safe: one poller."""

    last_error: str | None

    def poll(self) -> PreemptionNotice | None: ...

    def acknowledge(self, notice: PreemptionNotice) -> bool:
        """Tell the cloud the machine may go now (call it once the hand-over is done, never
        earlier: it shortens the time left). True if the cloud took it; False where the
        cloud has no such call or it failed."""
        ...


class _ProtocolError(ValueError):
    """The metadata service answered something its documentation does not allow."""


@dataclass(frozen=True)
class _Response:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


class _HttpWatcher:
    provider: str

    def __init__(
        self,
        config: NoticeConfig,
        clock: Callable[[], float] = time.time,
        timeout_s: float = HTTP_TIMEOUT_S,
    ) -> None:
        if config.provider != self.provider:
            raise ValueError(f"provider must be {self.provider!r} for {type(self).__name__}")
        self.config = config
        self.clock = clock
        self.timeout_s = timeout_s
        self.last_error: str | None = None
        self._scheme, self._host, self._port = _split_base_url(config.base_url)
        self._notice: PreemptionNotice | None = None

    def poll(self) -> PreemptionNotice | None:
        if self._notice is not None:
            return self._notice
        try:
            self._notice = self._check()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # ValueError: _ProtocolError, and http.client refusing a header value (a token
            # with a newline) that a broken service handed us.
            self.last_error = f"{self.provider} metadata at {self.config.base_url}: {exc!r}"
            return None
        self.last_error = None
        return self._notice

    def acknowledge(self, notice: PreemptionNotice) -> bool:
        return False

    def _check(self) -> PreemptionNotice | None:
        raise NotImplementedError

    def _request(
        self, method: str, path: str, headers: dict[str, str], body: bytes | None = None
    ) -> _Response:
        conn_cls = (
            http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        )
        conn = conn_cls(self._host, self._port, timeout=self.timeout_s)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return _Response(resp.status, resp.headers, resp.read(MAX_BODY_BYTES))
        finally:
            conn.close()


def _json_object(body: bytes) -> dict:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _ProtocolError(f"body is not JSON: {body[:200]!r}") from exc
    if not isinstance(doc, dict):
        raise _ProtocolError(f"body is not a JSON object: {body[:200]!r}")
    return doc


class AwsNoticeWatcher(_HttpWatcher):
    """EC2 spot `instance-action` through IMDSv2, with the session token cached."""

    provider = "aws"
    ACTIONS = ("terminate", "stop", "hibernate")

    def __init__(
        self,
        config: NoticeConfig,
        clock: Callable[[], float] = time.time,
        timeout_s: float = HTTP_TIMEOUT_S,
    ) -> None:
        super().__init__(config, clock, timeout_s)
        self._token: str | None = None
        self._token_expires_at = 0.0
        self.num_token_requests = 0

    def _fresh_token(self) -> str:
        if self._token is not None and self.clock() < self._token_expires_at:
            return self._token
        resp = self._request(
            "PUT",
            "/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
        )
        self.num_token_requests += 1
        token = resp.body.decode("ascii", "replace").strip()
        if resp.status != 200 or not token:
            raise _ProtocolError(f"token PUT answered {resp.status}")
        self._token = token
        self._token_expires_at = self.clock() + AWS_TOKEN_TTL_S - AWS_TOKEN_REFRESH_MARGIN_S
        return token

    def _get_action(self) -> _Response:
        return self._request(
            "GET",
            "/latest/meta-data/spot/instance-action",
            {"X-aws-ec2-metadata-token": self._fresh_token()},
        )

    def _check(self) -> PreemptionNotice | None:
        resp = self._get_action()
        if resp.status == 401:
            # The token was dropped before its TTL (IMDS restarted, instance stopped and
            # started): one fresh token, one retry.
            self._token = None
            resp = self._get_action()
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise _ProtocolError(f"instance-action answered {resp.status}")
        doc = _json_object(resp.body)
        action, when = doc.get("action"), doc.get("time")
        if action not in self.ACTIONS or not isinstance(when, str):
            raise _ProtocolError(f"instance-action body not as documented: {doc!r}")
        try:
            at = datetime.strptime(when, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
        except ValueError as exc:
            raise _ProtocolError(f"instance-action time {when!r} is not ISO 8601 UTC") from exc
        return PreemptionNotice("aws", at.timestamp(), f"spot instance-action {action} at {when}")


class GcpNoticeWatcher(_HttpWatcher):
    """Compute Engine `instance/preempted`; the deadline is 30 s after the first TRUE."""

    provider = "gcp"

    def _check(self) -> PreemptionNotice | None:
        resp = self._request(
            "GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}
        )
        if resp.status != 200:
            raise _ProtocolError(f"instance/preempted answered {resp.status}")
        if resp.headers.get("Metadata-Flavor") != "Google":
            # Not the metadata server (a proxy or captive portal answering for it).
            raise _ProtocolError("answer lacks the Metadata-Flavor: Google header")
        value = resp.body.strip()
        if value == b"FALSE":
            return None
        if value != b"TRUE":
            raise _ProtocolError(f"instance/preempted body {value[:50]!r} is not TRUE/FALSE")
        seen = self.clock()
        return PreemptionNotice("gcp", seen + GCP_NOTICE_S, "instance/preempted is TRUE")


class AzureNoticeWatcher(_HttpWatcher):
    """Azure Scheduled Events; a `Preempt` event (for `resource_name`, if set) is a notice.
    Other event types (Reboot, Redeploy, Freeze, Terminate) are maintenance, not spot
    eviction, and are left to whoever handles them."""

    provider = "azure"
    PATH = f"/metadata/scheduledevents?api-version={AZURE_API_VERSION}"

    def _check(self) -> PreemptionNotice | None:
        resp = self._request("GET", self.PATH, {"Metadata": "true"})
        if resp.status != 200:
            raise _ProtocolError(f"scheduledevents answered {resp.status}")
        events = _json_object(resp.body).get("Events")
        if not isinstance(events, list):
            raise _ProtocolError("scheduledevents body has no Events list")
        for event in events:
            if not isinstance(event, dict) or event.get("EventType") != "Preempt":
                continue
            name, resources = self.config.resource_name, event.get("Resources")
            if name is not None and not (isinstance(resources, list) and name in resources):
                continue
            return self._notice_of(event)
        return None

    def _notice_of(self, event: dict) -> PreemptionNotice:
        event_id, not_before = event.get("EventId"), event.get("NotBefore") or ""
        if not isinstance(event_id, str) or not isinstance(not_before, str):
            raise _ProtocolError(f"Preempt event not as documented: {event!r}")
        if not_before:
            try:
                at = parsedate_to_datetime(not_before)
            except (TypeError, ValueError) as exc:
                raise _ProtocolError(f"NotBefore {not_before!r} is not RFC 1123") from exc
            # RFC 1123 dates are GMT; a zone-less one would otherwise be read as local time.
            deadline = (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()
        else:
            # Blank once the event has started; Preempt's documented minimum notice is 30 s.
            deadline = self.clock() + AZURE_PREEMPT_NOTICE_S
        status = event.get("EventStatus")
        detail = f"Preempt {event_id} ({status}) not before {not_before or 'now'}"
        return PreemptionNotice("azure", deadline, detail, event_id=event_id)

    def acknowledge(self, notice: PreemptionNotice) -> bool:
        if notice.provider != "azure" or notice.event_id is None:
            raise ValueError(f"notice must be an Azure notice with an event_id, got {notice}")
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        headers = {"Metadata": "true", "Content-Type": "application/json"}
        try:
            resp = self._request("POST", self.PATH, headers, body)
        except (OSError, http.client.HTTPException) as exc:
            self.last_error = f"azure acknowledge of {notice.event_id}: {exc!r}"
            return False
        if resp.status != 200:
            self.last_error = f"azure acknowledge of {notice.event_id} answered {resp.status}"
            return False
        return True


_WATCHERS: dict[str, type[_HttpWatcher]] = {
    "aws": AwsNoticeWatcher,
    "gcp": GcpNoticeWatcher,
    "azure": AzureNoticeWatcher,
}


def make_watcher(config: NoticeConfig) -> NoticeWatcher:
    return _WATCHERS[config.provider](config)


class NoticeThread:
    """A daemon thread that polls `watcher` every `interval_s` until the first notice, hands
    it to `on_notice` once, and ends; or until `stop()`. `on_notice` runs on this thread:
    an asyncio owner passes it on with `loop.call_soon_threadsafe`, and should not block it
    for long (stop() waits only `timeout_s`). The wait between polls is an Event wait, so
    `stop()` returns after at most one HTTP timeout (`HTTP_TIMEOUT_S`) of a poll in flight."""

    def __init__(
        self,
        watcher: NoticeWatcher,
        on_notice: Callable[[PreemptionNotice], None],
        interval_s: float,
    ) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self.watcher = watcher
        self.on_notice = on_notice
        self.interval_s = interval_s
        self.notice: PreemptionNotice | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleetserve-notices", daemon=True)

    def start(self) -> NoticeThread:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2 * HTTP_TIMEOUT_S) -> None:
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the thread to end (after a notice was handled, or after stop())."""
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> NoticeThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        logged_error: str | None = None
        while not self._stopping.is_set():
            try:
                notice = self.watcher.poll()
            except Exception:  # a watcher that breaks its contract must not end watching
                logger.exception("notice watcher %s raised", type(self.watcher).__name__)
                self._stopping.wait(self.interval_s)
                continue
            if notice is not None:
                if self._stopping.is_set():
                    return
                self.notice = notice
                logger.warning(
                    "preemption notice: %s (%.1f s left)",
                    notice.detail,
                    notice.deadline - time.time(),
                )
                try:
                    self.on_notice(notice)
                except Exception:
                    logger.exception("on_notice failed for %s", notice)
                return
            error = self.watcher.last_error
            if error is not None and error != logged_error:
                # Once per distinct error: off the cloud this fails on every poll.
                logger.info("no preemption notice source: %s", error)
            logged_error = error
            self._stopping.wait(self.interval_s)


def start_notice_thread(
    config: NoticeConfig, on_notice: Callable[[PreemptionNotice], None]
) -> NoticeThread:
    """The watcher for `config`, polled every `config.poll_interval_s` on a started thread."""
    return NoticeThread(make_watcher(config), on_notice, config.poll_interval_s).start()
