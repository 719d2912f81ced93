"""Spot-preemption notice watchers against local stand-ins of the clouds' metadata services
(tests/serve/metadata_standins.py), which answer in the documented formats."""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from metadata_standins import AwsImdsStandIn, AzureScheduledEventsStandIn, GcpMetadataStandIn

from fleetserve.cloud.notices import (
    AWS_TOKEN_REFRESH_MARGIN_S,
    AWS_TOKEN_TTL_S,
    AwsNoticeWatcher,
    AzureNoticeWatcher,
    GcpNoticeWatcher,
    NoticeConfig,
    NoticeThread,
    PreemptionNotice,
    make_watcher,
    start_notice_thread,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _raw_get(url: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.headers), resp.read()
    finally:
        conn.close()


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# --- config -----------------------------------------------------------------------------


def test_config_defaults_are_the_documented_addresses() -> None:
    assert NoticeConfig("aws").base_url == "http://169.254.169.254"
    assert NoticeConfig("azure").base_url == "http://169.254.169.254"
    assert NoticeConfig("gcp").base_url == "http://metadata.google.internal"
    assert NoticeConfig("gcp", url="https://10.0.0.1:8443/").base_url == "https://10.0.0.1:8443"
    assert NoticeConfig("aws").poll_interval_s == 1.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"provider": "oracle"}, "provider"),
        ({"provider": "AWS"}, "provider"),
        ({"provider": "aws", "url": "169.254.169.254"}, "url"),
        ({"provider": "aws", "url": "ftp://169.254.169.254"}, "url"),
        ({"provider": "aws", "url": "http://"}, "url"),
        ({"provider": "aws", "url": "http://host:99999"}, "url"),
        ({"provider": "aws", "url": "http://host/latest"}, "url"),
        ({"provider": "aws", "url": "http://host?x=1"}, "url"),
        ({"provider": "aws", "url": "http://user@host"}, "url"),
        ({"provider": "gcp", "poll_interval_s": 0}, "poll_interval_s"),
        ({"provider": "gcp", "poll_interval_s": -1.0}, "poll_interval_s"),
        ({"provider": "gcp", "poll_interval_s": 60.5}, "poll_interval_s"),
        ({"provider": "gcp", "poll_interval_s": float("nan")}, "poll_interval_s"),
        ({"provider": "gcp", "poll_interval_s": True}, "poll_interval_s"),
        ({"provider": "gcp", "poll_interval_s": "1"}, "poll_interval_s"),
        ({"provider": "aws", "resource_name": "vm-1"}, "resource_name"),
        ({"provider": "azure", "resource_name": ""}, "resource_name"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NoticeConfig(**kwargs)


def test_make_watcher_picks_the_provider() -> None:
    assert isinstance(make_watcher(NoticeConfig("aws")), AwsNoticeWatcher)
    assert isinstance(make_watcher(NoticeConfig("gcp")), GcpNoticeWatcher)
    assert isinstance(make_watcher(NoticeConfig("azure")), AzureNoticeWatcher)
    with pytest.raises(ValueError, match="provider"):
        AwsNoticeWatcher(NoticeConfig("gcp"))


# --- AWS IMDSv2 -------------------------------------------------------------------------


@pytest.fixture
def aws() -> Iterator[AwsImdsStandIn]:
    with AwsImdsStandIn() as standin:
        yield standin


def test_aws_standin_refuses_get_without_a_valid_token(aws: AwsImdsStandIn) -> None:
    path = "/latest/meta-data/spot/instance-action"
    assert _raw_get(aws.url, path, {})[0] == 401
    assert _raw_get(aws.url, path, {"X-aws-ec2-metadata-token": "made-up"})[0] == 401


def test_aws_no_notice_then_notice_with_the_documented_time(aws: AwsImdsStandIn) -> None:
    watcher = AwsNoticeWatcher(NoticeConfig("aws", url=aws.url))
    assert watcher.poll() is None
    assert watcher.poll() is None
    assert watcher.last_error is None
    at = aws.preempt_in(120.0, action="stop")
    notice = watcher.poll()
    assert notice is not None
    assert notice.provider == "aws"
    assert notice.deadline == at
    assert "stop" in notice.detail
    # One token for all checks: IMDSv2 tokens are cached until near their TTL.
    assert aws.num_token_puts == 1
    assert aws.num_unauthorized == 0
    # A notice stays, with the same deadline, even if the cloud withdraws the item.
    aws.instance_action = None
    assert watcher.poll() == notice


def test_aws_token_refreshed_on_401(aws: AwsImdsStandIn) -> None:
    watcher = AwsNoticeWatcher(NoticeConfig("aws", url=aws.url))
    assert watcher.poll() is None
    aws.revoke_tokens()
    at = aws.preempt_in(90.0)
    notice = watcher.poll()
    assert notice is not None and notice.deadline == at
    assert (aws.num_unauthorized, aws.num_token_puts) == (1, 2)
    assert watcher.last_error is None


def test_aws_token_expired_at_the_service_is_refreshed() -> None:
    clock = FakeClock()
    with AwsImdsStandIn(clock=clock) as aws:
        watcher = AwsNoticeWatcher(NoticeConfig("aws", url=aws.url))
        assert watcher.poll() is None
        clock.now += AWS_TOKEN_TTL_S + 1  # only the service's clock: the watcher's is real
        assert watcher.poll() is None
        assert watcher.last_error is None
        assert (aws.num_unauthorized, aws.num_token_puts) == (1, 2)


def test_aws_token_refreshed_before_its_ttl(aws: AwsImdsStandIn) -> None:
    clock = FakeClock()
    watcher = AwsNoticeWatcher(NoticeConfig("aws", url=aws.url), clock=clock)
    assert watcher.poll() is None
    clock.now += AWS_TOKEN_TTL_S - AWS_TOKEN_REFRESH_MARGIN_S - 1
    assert watcher.poll() is None
    assert aws.num_token_puts == 1
    clock.now += 2
    assert watcher.poll() is None
    assert (aws.num_unauthorized, aws.num_token_puts) == (0, 2)


def test_aws_undocumented_action_is_an_error_not_a_crash(aws: AwsImdsStandIn) -> None:
    watcher = AwsNoticeWatcher(NoticeConfig("aws", url=aws.url))
    aws.instance_action = {"action": "explode", "time": "2017-09-18T08:22:00Z"}
    assert watcher.poll() is None
    assert watcher.last_error is not None and "explode" in watcher.last_error


# --- GCP ----------------------------------------------------------------------------------


def test_gcp_no_notice_then_thirty_seconds_from_first_true() -> None:
    clock = FakeClock()
    with GcpMetadataStandIn() as gcp:
        watcher = GcpNoticeWatcher(NoticeConfig("gcp", url=gcp.url), clock=clock)
        assert watcher.poll() is None
        assert watcher.last_error is None
        gcp.preempt()
        first_seen = clock.now
        notice = watcher.poll()
        assert notice == PreemptionNotice("gcp", first_seen + 30.0, "instance/preempted is TRUE")
        clock.now += 10
        assert watcher.poll() == notice


def test_gcp_standin_refuses_without_flavor_header() -> None:
    with GcpMetadataStandIn() as gcp:
        path = "/computeMetadata/v1/instance/preempted"
        assert _raw_get(gcp.url, path, {})[0] == 403
        status, headers, body = _raw_get(gcp.url, path, {"Metadata-Flavor": "Google"})
        assert (status, headers["Metadata-Flavor"], body) == (200, "Google", b"FALSE")


def test_gcp_answer_without_flavor_header_is_not_trusted() -> None:
    with GcpMetadataStandIn(flavor_header=False) as gcp:
        gcp.preempt()
        watcher = GcpNoticeWatcher(NoticeConfig("gcp", url=gcp.url))
        assert watcher.poll() is None
        assert watcher.last_error is not None and "Metadata-Flavor" in watcher.last_error


# --- Azure --------------------------------------------------------------------------------


def test_azure_only_preempt_events_are_notices() -> None:
    with AzureScheduledEventsStandIn() as azure:
        watcher = AzureNoticeWatcher(NoticeConfig("azure", url=azure.url))
        assert watcher.poll() is None
        for event_type in ("Reboot", "Redeploy", "Freeze", "Terminate"):
            azure.add_event(event_type, ["vm-1"], 600.0)
        assert watcher.poll() is None
        assert watcher.last_error is None
        event_id = azure.preempt_in(45.0, ["vm-1"])
        notice = watcher.poll()
        assert notice is not None
        assert (notice.provider, notice.event_id) == ("azure", event_id)
        # NotBefore is an RFC 1123 date: whole seconds.
        assert int(time.time() + 45.0) - 1 <= notice.deadline <= time.time() + 45.0
        assert event_id in notice.detail


def test_azure_resource_name_filters_other_vms() -> None:
    with AzureScheduledEventsStandIn() as azure:
        config = NoticeConfig("azure", url=azure.url, resource_name="vm-1")
        watcher = AzureNoticeWatcher(config)
        azure.preempt_in(30.0, ["vm-2", "vm-3"])
        assert watcher.poll() is None
        mine = azure.preempt_in(30.0, ["vm-2", "vm-1"])
        notice = watcher.poll()
        assert notice is not None and notice.event_id == mine


def test_azure_blank_not_before_means_thirty_seconds() -> None:
    clock = FakeClock()
    with AzureScheduledEventsStandIn() as azure:
        watcher = AzureNoticeWatcher(NoticeConfig("azure", url=azure.url), clock=clock)
        azure.add_event("Preempt", ["vm-1"], not_before_in_s=None, status="Started")
        notice = watcher.poll()
        assert notice is not None and notice.deadline == clock.now + 30.0


def test_azure_acknowledge_is_explicit_and_starts_the_event() -> None:
    with AzureScheduledEventsStandIn() as azure:
        watcher = AzureNoticeWatcher(NoticeConfig("azure", url=azure.url))
        event_id = azure.preempt_in(30.0, ["vm-1"])
        notice = watcher.poll()
        assert notice is not None
        assert azure.acknowledged == []  # polling alone never acknowledges
        assert watcher.acknowledge(notice) is True
        assert azure.acknowledged == [event_id]
        assert azure.events[0]["EventStatus"] == "Started"
        assert azure.events[0]["NotBefore"] == ""


def test_azure_standin_refuses_without_metadata_header() -> None:
    with AzureScheduledEventsStandIn() as azure:
        path = "/metadata/scheduledevents?api-version=2020-07-01"
        assert _raw_get(azure.url, path, {})[0] == 400
        assert _raw_get(azure.url, "/metadata/scheduledevents", {"Metadata": "true"})[0] == 400
        status, _, body = _raw_get(azure.url, path, {"Metadata": "true"})
        assert (status, body) == (200, b'{"DocumentIncarnation": 1, "Events": []}')


def test_acknowledge_is_a_no_op_where_the_cloud_has_none(aws: AwsImdsStandIn) -> None:
    watcher = AwsNoticeWatcher(NoticeConfig("aws", url=aws.url))
    aws.preempt_in(120.0)
    notice = watcher.poll()
    assert notice is not None
    requests_before = aws.num_requests
    assert watcher.acknowledge(notice) is False
    assert aws.num_requests == requests_before


# --- unreachable or silent endpoints ------------------------------------------------------


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_unreachable_endpoint_gives_none_and_an_error(provider: str) -> None:
    watcher = make_watcher(NoticeConfig(provider, url=_closed_port_url()))  # type: ignore[arg-type]
    assert watcher.poll() is None
    assert watcher.last_error is not None and "Connection" in watcher.last_error


@pytest.mark.parametrize("watcher_cls", [AwsNoticeWatcher, GcpNoticeWatcher, AzureNoticeWatcher])
def test_silent_endpoint_times_out_to_none(
    watcher_cls: type[AwsNoticeWatcher | GcpNoticeWatcher | AzureNoticeWatcher],
) -> None:
    # Listens (the kernel completes the connect) but never answers.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        watcher = watcher_cls(NoticeConfig(watcher_cls.provider, url=url), timeout_s=0.2)
        assert watcher.poll() is None
        assert watcher.last_error is not None and "timed out" in watcher.last_error


# --- NoticeThread -------------------------------------------------------------------------


def test_notice_thread_calls_back_once_then_ends() -> None:
    with GcpMetadataStandIn() as gcp:
        watcher = GcpNoticeWatcher(NoticeConfig("gcp", url=gcp.url))
        calls: list[PreemptionNotice] = []
        called = threading.Event()

        def on_notice(notice: PreemptionNotice) -> None:
            calls.append(notice)
            called.set()

        with NoticeThread(watcher, on_notice, interval_s=0.05) as thread:
            _wait_until(lambda: gcp.num_requests >= 2)  # polling, nothing announced yet
            assert calls == []
            gcp.preempt()
            assert called.wait(10.0)
            thread.join(10.0)  # ends by itself after the notice, no stop() needed
            assert not thread.is_alive()
            requests_after = gcp.num_requests
            time.sleep(0.2)  # four intervals: a live poller would have asked again
            assert gcp.num_requests == requests_after
            assert len(calls) == 1 and calls[0].provider == "gcp"
            assert thread.notice == calls[0]


def test_notice_thread_stop_interrupts_the_wait() -> None:
    with AwsImdsStandIn() as aws:
        watcher = AwsNoticeWatcher(NoticeConfig("aws", url=aws.url))
        thread = NoticeThread(watcher, lambda notice: None, interval_s=3600.0).start()
        _wait_until(lambda: aws.num_requests >= 2)  # token PUT + first check: now waiting
        thread.stop(timeout_s=10.0)
        assert not thread.is_alive()  # a sleep(3600) would still be running
        assert thread.notice is None


def test_notice_thread_survives_a_failing_callback(caplog: pytest.LogCaptureFixture) -> None:
    with GcpMetadataStandIn() as gcp:
        gcp.preempt()
        watcher = GcpNoticeWatcher(NoticeConfig("gcp", url=gcp.url))

        def on_notice(notice: PreemptionNotice) -> None:
            raise RuntimeError("drain failed")

        with caplog.at_level(logging.ERROR, logger="fleetserve.cloud.notices"):
            thread = NoticeThread(watcher, on_notice, interval_s=0.05).start()
            thread.join(10.0)
        assert not thread.is_alive()
        assert "drain failed" in caplog.text


def test_start_notice_thread_uses_the_config() -> None:
    with AzureScheduledEventsStandIn() as azure:
        azure.add_event("Reboot", ["vm-1"])
        event_id = azure.preempt_in(30.0, ["vm-1"])
        notices: list[PreemptionNotice] = []
        config = NoticeConfig("azure", url=azure.url, poll_interval_s=0.05, resource_name="vm-1")
        thread = start_notice_thread(config, notices.append)
        thread.join(10.0)
        assert not thread.is_alive()
        assert [notice.event_id for notice in notices] == [event_id]


class _BrokenWatcher:
    """Breaks the contract (poll raises) for its first two polls."""

    last_error: str | None = None

    def __init__(self) -> None:
        self.num_polls = 0

    def poll(self) -> PreemptionNotice | None:
        self.num_polls += 1
        if self.num_polls <= 2:
            raise RuntimeError("bug in a watcher")
        return PreemptionNotice("test", 0.0, "third poll")

    def acknowledge(self, notice: PreemptionNotice) -> bool:
        return False


def test_notice_thread_keeps_polling_past_a_raising_watcher() -> None:
    watcher = _BrokenWatcher()
    notices: list[PreemptionNotice] = []
    thread = NoticeThread(watcher, notices.append, interval_s=0.01).start()
    thread.join(10.0)
    assert not thread.is_alive()
    assert (watcher.num_polls, [n.detail for n in notices]) == (3, ["third poll"])


@pytest.mark.parametrize("interval_s", [0.0, -1.0, float("inf")])
def test_notice_thread_interval_must_be_positive(interval_s: float) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        NoticeThread(make_watcher(NoticeConfig("gcp")), lambda notice: None, interval_s)
