"""SIGTERM drain, a dead engine process, a dead API process: no hang, no orphans."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_proc import ServerProc, pid_alive, wait_until


@pytest.fixture
def fresh_server(tiny_llama: str) -> Iterator[Any]:
    """`start(*args) -> ServerProc`, each one stopped (and its children reaped) at the end."""
    started: list[ServerProc] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProc:
        srv = ServerProc(tiny_llama, *args, env=env)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop(timeout_s=10)


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background; records its events."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[Any] = []
        self.first = threading.Event()
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json=self.body, timeout=60
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 -- the test inspects it
            self.error = e
        finally:
            self.first.set()

    @property
    def finish_reason(self) -> str | None:
        for ev in self.events:
            if isinstance(ev, dict) and ev.get("choices") and ev["choices"][0]["finish_reason"]:
                return ev["choices"][0]["finish_reason"]
        return None

    @property
    def error_event(self) -> dict[str, Any] | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)


def test_sigterm_drains(fresh_server: Any) -> None:
    # Paced steps (10 ms each): the 60-token request ends well inside the 4 s drain window,
    # the 2040-token one cannot, however fast the engine has become on this machine.
    srv = fresh_server(
        "--drain-timeout", "4", "--max-num-seqs", "4",
        env={"FLEETSERVE_DEBUG_STEP_DELAY_S": "0.01"},
    )  # fmt: skip
    srv.wait_ready()
    core_pid = srv.core_pid
    assert core_pid is not None and pid_alive(core_pid)
    short = StreamReader(
        srv.url, {"prompt": "a", "max_tokens": 60, "ignore_eos": True, "stream": True}
    )
    long = StreamReader(
        srv.url, {"prompt": "b", "max_tokens": 2040, "ignore_eos": True, "stream": True}
    )
    short.start()
    long.start()
    assert short.first.wait(30) and long.first.wait(30)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    # Draining: not ready, not healthy (no new traffic, please), new work refused,
    # liveness still fine.
    assert wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 503, 5)
    refused = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"
    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/live").status_code == 200
    # The short request finishes normally; the long one is cut at the drain timeout.
    short.join(30)
    assert short.finish_reason == "length" and short.events[-1] == "[DONE]", short.events[-3:]
    long.join(30)
    assert not long.is_alive()
    assert long.events[-1] == "[DONE]"
    assert long.error_event is not None and long.error_event["code"] == "engine_unavailable"
    assert srv.proc.wait(30) == 0
    assert time.monotonic() - t0 < 25
    assert wait_until(lambda: not pid_alive(core_pid), 5)


def test_engine_killed_under_load_without_replacement(fresh_server: Any) -> None:
    """With no replica to move to (one replica, not replaced) a lost engine ends every
    request at once with a clear error; tests/server/test_chaos.py has the default, where
    requests move to a replacement."""
    srv = fresh_server("--no-replace-failed").wait_ready()
    core_pid = srv.core_pid
    assert core_pid is not None
    body = {"prompt": "c", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    readers = [StreamReader(srv.url, body) for _ in range(4)]
    for r in readers:
        r.start()
    assert all(r.first.wait(30) for r in readers)
    non_streaming: dict[str, httpx.Response] = {}

    def post() -> None:
        non_streaming["r"] = httpx.post(
            f"{srv.url}/v1/completions", json={**body, "stream": False}, timeout=60
        )

    t = threading.Thread(target=post, daemon=True)
    t.start()
    time.sleep(0.5)
    import os

    os.kill(core_pid, signal.SIGKILL)
    for r in readers:
        r.join(15)
        assert not r.is_alive(), "a stream hung after the engine died"
        assert r.error_event is not None and r.error_event["code"] == "engine_unavailable"
        assert r.events[-1] == "[DONE]"
    t.join(15)
    assert non_streaming["r"].status_code == 503
    assert "engine" in non_streaming["r"].json()["error"]["message"]
    assert httpx.get(f"{srv.url}/health").status_code == 503
    new = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert new.status_code == 503
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 1  # exits, and says the engine failed
    assert srv.descendants() == []


def test_core_exits_when_api_process_dies(fresh_server: Any) -> None:
    srv = fresh_server()

    def alive() -> bool:
        try:
            return httpx.get(f"{srv.url}/live", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    # While the engine loads, HTTP already answers: alive, not ready nor healthy, requests
    # get 503.
    assert wait_until(alive, 60)
    if httpx.get(f"{srv.url}/ready").status_code == 503:
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code in (200, 503)  # 200 if loading finished in between
        if health.status_code == 503:
            assert health.json()["error"]["message"].startswith("loading: ")
        resp = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert resp.status_code in (200, 503)  # 200 if loading finished in between
        if resp.status_code == 503:
            assert resp.json()["error"]["code"] == "loading"
            assert resp.headers["Retry-After"].isdigit()
    srv.wait_ready()
    core_pid = srv.core_pid
    assert core_pid is not None
    srv.proc.kill()
    srv.proc.wait(10)
    assert wait_until(lambda: not pid_alive(core_pid), 10), "orphaned engine process"
