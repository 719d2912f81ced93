"""Custom handlers against a real `fleetserve serve`: nothing one does takes the server or
the other models down. sys.exit and KeyboardInterrupt in a handler are a 500 for that
request; a hung call is a 504 at the model's timeout_s while /health, /ready and the
dashboard say the model is unhealthy, and the other models keep answering; a handler
process that dies is restarted."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from server_proc import ServerProc, wait_until


@pytest.fixture(scope="module")
def server(pipeline_fleet: ServerProc) -> ServerProc:
    """The session's pipeline fleet (tests/server/pipeline_fleet.py)."""
    return pipeline_fleet


def predict(srv: ServerProc, model: str, *instances: dict[str, Any]) -> httpx.Response:
    body = {"instances": list(instances)}
    return httpx.post(f"{srv.url}/v1/models/{model}:predict", json=body, timeout=120)


def others_answer(srv: ServerProc) -> None:
    """The server and its other models serve."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
    good = predict(srv, "good", {"text": "ab"})
    assert good.status_code == 200 and good.json()["predictions"] == [
        {"label": "even", "length": 2}
    ]


@pytest.mark.parametrize(
    "instance", [{"exit": 3}, {"interrupt": True}, {"base": True}, {"os_exit": 7}]
)
def test_what_a_handler_raises_or_exits_with_is_a_500(
    server: ServerProc, instance: dict[str, Any]
) -> None:
    resp = predict(server, "bad", instance)
    assert resp.status_code == 500, resp.text
    assert resp.json()["error"]["code"] == "model_error"
    assert server.proc.poll() is None
    others_answer(server)
    # The model itself serves again (a dead handler process was restarted).
    assert wait_until(lambda: predict(server, "bad", {"x": 1}).status_code == 200, 60)


def test_a_hung_handler_is_a_504_and_its_model_unhealthy_meanwhile(server: ServerProc) -> None:
    got: dict[str, Any] = {}

    def hang() -> None:
        started = time.monotonic()
        got["resp"] = predict(server, "bad", {"sleep": 90})
        got["took"] = time.monotonic() - started

    thread = threading.Thread(target=hang)
    thread.start()
    try:
        # Stuck past half its timeout: /health and /ready say so, naming the model.
        assert wait_until(
            lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503, 30, 0.1
        )
        health = httpx.get(f"{server.url}/health", timeout=10)
        if health.status_code == 503:  # (the call may have ended since)
            assert "'bad' is unhealthy" in health.json()["error"]["message"]
        others_answer(server)  # the other models are not held by it
    finally:
        thread.join(120)
    resp = got["resp"]
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "timeout"
    assert got["took"] < 60  # ended at timeout_s (4 s), not the handler's 90
    assert wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200, 60)
    assert predict(server, "bad", {"x": 1}).status_code == 200


def test_the_dashboard_shows_a_stuck_handler(server: ServerProc) -> None:
    thread = threading.Thread(target=lambda: predict(server, "bad", {"sleep": 90}))
    thread.start()
    try:

        def state() -> str | None:
            snap = httpx.get(f"{server.url}/dashboard/api/snapshot", timeout=10).json()
            return next((m["state"] for m in snap["models"] if m["name"] == "bad"), None)

        assert wait_until(lambda: state() == "unhealthy", 30, 0.1)
    finally:
        thread.join(120)
    assert wait_until(lambda: state() == "ready", 60)
