"""The access log of a real fleet server: one JSON line per request on its stdout, with
the id it returned in X-Request-Id, the model, class, replicas, migrations, status, token
counts (as the response's usage says) and timings; and the response counts by status."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
from ops_fleet import OPS_API_KEY
from server_proc import ServerProc, metric, scrape, wait_until

AUTH = {"Authorization": f"Bearer {OPS_API_KEY}"}


def lines(srv: ServerProc) -> list[dict[str, Any]]:
    out = []
    for text in srv.output().splitlines():
        if text.startswith("{"):
            line = json.loads(text)
            if "request_id" in line:
                out.append(line)
    return out


def line_for(srv: ServerProc, request_id: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def logged() -> bool:
        found[:] = [x for x in lines(srv) if x["request_id"] == request_id]
        return bool(found)

    assert wait_until(logged, 10), f"no access line for {request_id}:\n{srv.output()[-3000:]}"
    assert len(found) == 1, found
    return found[0]


def test_a_normal_request_is_one_line_with_its_usage(ops_fleet: ServerProc) -> None:
    body = {"model": "chat-a", "prompt": "the access log", "max_tokens": 5, "temperature": 0}
    headers = {**AUTH, "X-Request-Id": "client-id-1"}
    r = httpx.post(f"{ops_fleet.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "client-id-1"  # a sane client id is kept
    line = line_for(ops_fleet, "client-id-1")
    usage = r.json()["usage"]
    assert line["method"] == "POST" and line["path"] == "/v1/completions"
    assert line["status"] == 200 and line["model"] == "chat-a" and line["class"] == "interactive"
    assert line["response_id"] == r.json()["id"]
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"] == 5
    assert len(line["replicas"]) == 1 and line["migrations"] == 0
    assert 0 < line["ttft_s"] <= line["duration_s"]
    assert line["client"] == "127.0.0.1" and line["time"].endswith("Z")


def test_a_streamed_request_is_timed_to_its_last_byte(ops_fleet: ServerProc) -> None:
    body = {
        "model": "chat-b",
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {**AUTH, "X-Fleetserve-Class": "batch", "X-Request-Id": "bad id\twith spaces"}
    usage = None
    with httpx.stream(
        "POST", f"{ops_fleet.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        for text in r.iter_lines():
            if text.startswith("data: {"):
                chunk = json.loads(text[len("data: ") :])
                usage = chunk.get("usage") or usage
    # A client id with spaces or tabs is not echoed into logs: the server makes its own.
    assert request_id != "bad id\twith spaces" and len(request_id) == 32
    assert usage is not None
    line = line_for(ops_fleet, request_id)
    assert line["status"] == 200 and line["model"] == "chat-b" and line["class"] == "batch"
    assert line["path"] == "/v1/chat/completions"
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert line["replicas"] == [0] and line["migrations"] == 0  # chat-b has one replica
    # 12 engine steps of at least 0.02 s each come after the first token.
    assert 0 < line["ttft_s"] < line["duration_s"] and line["duration_s"] >= 0.2
    assert "error" not in line and "client_gone" not in line


def test_4xx_requests_are_logged_with_what_is_known(ops_fleet: ServerProc) -> None:
    url = ops_fleet.url
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=OPS_API_KEY, max_retries=0)
    # An unknown class: the model is known, the class is not (so it is no label either).
    raw = c.completions.with_raw_response
    try:
        raw.create(
            model="chat-a", prompt="x", max_tokens=1, extra_headers={"X-Fleetserve-Class": "gold"}
        )
        raise AssertionError("an unknown class must be refused")
    except openai.BadRequestError as e:
        gold_id = e.response.headers["x-request-id"]
    line = line_for(ops_fleet, gold_id)
    assert line["status"] == 400 and line["model"] == "chat-a" and line["class"] is None
    assert "replicas" not in line and "prompt_tokens" not in line
    # No key: refused before any handler, still one line with an id.
    r = httpx.post(f"{url}/v1/completions", json={"model": "chat-a", "prompt": "x"}, timeout=10)
    assert r.status_code == 401
    line = line_for(ops_fleet, r.headers["x-request-id"])
    assert line["status"] == 401 and line["model"] is None and line["duration_s"] >= 0
    # An unknown model: 404, and its name is no series label.
    r = httpx.post(
        f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=AUTH, timeout=10
    )
    assert r.status_code == 404
    assert line_for(ops_fleet, r.headers["x-request-id"])["status"] == 404
    values = scrape(url, AUTH)
    assert metric(values, "fleetserve:http_requests_total", model_name="chat-a", status="400") >= 1
    # By route: the matched route's template (one series per route, whatever the path).
    chat_400 = {"model_name": "chat-a", "status": "400", "route": "/v1/completions"}
    assert metric(values, "fleetserve:http_requests_total", **chat_400) >= 1
    assert metric(values, "fleetserve:http_requests_total", model_name="nope") == 0
    assert 'class="gold"' not in "".join(values)


def test_probes_and_scrapes_are_not_logged(ops_fleet: ServerProc) -> None:
    for path in ("/health", "/live", "/ready"):
        r = httpx.get(f"{ops_fleet.url}{path}", headers={"X-Request-Id": f"probe{path}"})
        assert r.status_code == 200 and r.headers["x-request-id"] == f"probe{path}"
    marker = httpx.get(f"{ops_fleet.url}/v1/models", headers={**AUTH, "X-Request-Id": "after"})
    assert marker.status_code == 200
    line_for(ops_fleet, "after")
    assert not [x for x in lines(ops_fleet) if x["request_id"].startswith("probe")]


def _replicas(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/admin/replicas", headers=AUTH, timeout=10).json()["data"]


def test_a_moved_request_names_both_replicas(ops_fleet: ServerProc) -> None:
    """A replica drained under a stream: the stream moves, and its line says where it ran."""
    url = ops_fleet.url
    assert wait_until(
        lambda: sum(r["state"] == "ready" for r in _replicas(url) if r["model"] == "chat-a") == 2,
        120,
    )
    drained: list[str] = []

    def drain_its_replica() -> None:
        def busy() -> bool:
            drained[:] = [
                r["id"] for r in _replicas(url) if r["model"] == "chat-a" and r["num_requests"]
            ]
            return bool(drained)

        assert wait_until(busy, 30)
        resp = httpx.post(
            f"{url}/admin/replicas/{drained[0]}/drain", json={"timeout_s": 0}, headers=AUTH
        )
        assert resp.status_code == 202, resp.text

    body = {"model": "chat-a", "prompt": "moving", "max_tokens": 80, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    chaos = threading.Thread(target=drain_its_replica)
    started = time.monotonic()
    chaos.start()
    headers = {**AUTH, "X-Request-Id": "moved-1"}
    num_chunks = 0
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        num_chunks = sum(1 for t in r.iter_lines() if t.startswith("data: {"))
    chaos.join(timeout=60)
    assert drained and num_chunks > 0, time.monotonic() - started
    line = line_for(ops_fleet, "moved-1")
    assert line["status"] == 200 and "error" not in line
    assert line["migrations"] == 1 and len(line["replicas"]) == 2
    assert line["replicas"][0] == int(drained[0].rpartition(":")[2])
    assert line["completion_tokens"] == 80


def test_openai_metadata_is_written_into_the_line(ops_fleet: ServerProc) -> None:
    """OpenAI's `metadata` (and `store: false`) are accepted; we store nothing, so the
    metadata lives in the request's access line."""
    body = {
        "model": "chat-b",
        "messages": [{"role": "user", "content": "tag me"}],
        "max_tokens": 3,
        "store": False,
        "metadata": {"team": "qa", "run": "7"},
    }
    headers = {**AUTH, "X-Request-Id": "metadata-1"}
    r = httpx.post(f"{ops_fleet.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert line_for(ops_fleet, "metadata-1")["metadata"] == {"team": "qa", "run": "7"}
