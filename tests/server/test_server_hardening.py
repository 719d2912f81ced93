"""Regression tests for the front-door defects of issue 14, one or more per defect, against a
real server process: each failed on the code before the fix."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from server_proc import ServerProc, metric, scrape

from fleetserve.entrypoints.openai.server_args import api_key_from

WAITING_BOUND = 2
READ_TIMEOUT_S = 1.0
ORIGIN = "https://app.example"
JSON = {"Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tiny_llama: str) -> Iterator[ServerProc]:
    s = ServerProc(
        tiny_llama,
        "--max-model-len", "256", "--max-num-seqs", "1",
        "--max-waiting-requests", str(WAITING_BOUND),
        "--request-read-timeout", str(READ_TIMEOUT_S),
        "--allowed-origins", ORIGIN,
    )  # fmt: skip
    try:
        yield s.wait_ready()
    finally:
        code = s.stop()
        assert code == 0, s.final_output


@pytest.fixture(scope="module")
def http(srv: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def raw_post(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a JSON text as written (json= would refuse to encode a lone surrogate)."""
    return http.post(path, content=text.encode("utf-8"), headers=JSON)


def check_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def bound_is_free(http: httpx.Client) -> None:
    """As many concurrent good requests as the waiting bound are all served."""

    def one(i: int) -> int:
        body = {"prompt": f"hello {i}", "max_tokens": 8}
        return http.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(WAITING_BOUND) as pool:
        assert list(pool.map(one, range(WAITING_BOUND))) == [200] * WAITING_BOUND


# 1. A lone surrogate in `stop` leaked a waiting slot per request until every request got 503.
SURROGATE_BODIES = [
    ("/v1/completions", '{"prompt": "hi", "stop": "\\udbff"}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop.1"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "stop": "\\udbff"}',
        "stop",
    ),  # noqa: E501
]


def test_surrogate_stop_does_not_leak_waiting_slots(http: httpx.Client, srv: ServerProc) -> None:
    for path, text, param in SURROGATE_BODIES * (3 * WAITING_BOUND):
        check_error(raw_post(http, path, text), 400, param)
    bound_is_free(http)
    values = scrape(srv.url)
    assert metric(values, "fleetserve:num_requests_waiting") == 0
    assert "Traceback" not in srv.output()


# 2. (and the generalisation) Unencodable text in any field is a 400 naming it, never a 500.
@pytest.mark.parametrize(
    ("path", "text", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": "a\\ud800b", "stream": true}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
        ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
        ("/v1/completions", '{"prompt": "hi", "user": "\\ud800"}', "user"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages.0.content"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
         "messages.0.content.0.text"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "hi", "name": "\\ud801"}]}',
         "messages.0.name"),
    ],
)  # fmt: skip
def test_unencodable_text_is_400_naming_the_field(
    http: httpx.Client, path: str, text: str, param: str
) -> None:
    err = check_error(raw_post(http, path, text), 400, param)
    assert "Unicode" in err["message"]


def test_nul_bytes_and_odd_text_are_served(http: httpx.Client) -> None:
    for prompt in ["a\x00b", "\ufeff\u0301\u200b", "ｆｕｌｌ" * 20, "\U0001f600" * 30]:
        resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
    resp = http.post("/v1/completions", json={"prompt": "x", "model": "m" * 100_000})
    err = check_error(resp, 404, "model")
    assert len(err["message"]) < 1000


# 3. Cross-site requests: only JSON bodies; CORS only for the allowed origins.
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_non_json_content_type_is_415(http: httpx.Client, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    resp = http.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
    check_error(resp, 415)


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", '"utf-8"', "utf8"])
def test_json_with_charset_is_accepted(http: httpx.Client, charset: str) -> None:
    headers = {"Content-Type": f"application/json; charset={charset}"}
    resp = http.post(
        "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers
    )
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("charset", ["utf-16", "latin-1", "utf-16le"])
def test_json_in_another_charset_is_415(http: httpx.Client, charset: str) -> None:
    # A UTF-8 body declared as another charset would be read as what it is not.
    headers = {"Content-Type": f"application/json; charset={charset}"}
    resp = http.post(
        "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers
    )
    err = check_error(resp, 415)
    assert "charset" in err["message"]


def test_cors_only_for_allowed_origins(http: httpx.Client) -> None:
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    ok = http.options("/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    evil = http.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in evil.headers
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                     headers={"Origin": "https://evil.example"})  # fmt: skip
    assert "access-control-allow-origin" not in resp.headers


# 4 and 5. Slow or vanishing clients: bounded, and no traceback per disconnect.
def _connect(srv: ServerProc) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


HEAD = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_slow_body_gets_408_and_is_closed(srv: ServerProc) -> None:
    with _connect(srv) as s:
        s.sendall(f"{HEAD}Content-Length: 100\r\n\r\n".encode() + b'{"prompt":')
        t0 = time.monotonic()
        reply = _read_all(s)  # returns once the server closes the connection
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 5
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"request_timeout"' in reply


def test_slow_headers_get_408_and_are_closed(srv: ServerProc) -> None:
    with _connect(srv) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        reply = _read_all(s)
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 5
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    with _connect(srv) as s:  # a connection that never sends a byte is closed too
        assert _read_all(s).startswith(b"HTTP/1.1 408")


def test_disconnect_during_body_logs_no_traceback(srv: ServerProc, http: httpx.Client) -> None:
    for _ in range(5):
        with _connect(srv) as s:
            s.sendall(f"{HEAD}Content-Length: 1000\r\n\r\n".encode() + b'{"prompt": "x')
            time.sleep(0.05)
    time.sleep(0.3)
    assert http.get("/health").status_code == 200
    out = srv.output()
    assert "Traceback" not in out and "ClientDisconnect" not in out, out[-3000:]


# 6. Auth traps are refused at start-up.
def test_api_key_rules() -> None:
    assert api_key_from(None, {}) is None
    assert api_key_from("k3y", {"FLEETSERVE_API_KEY": "other"}) == "k3y"
    assert api_key_from(None, {"FLEETSERVE_API_KEY": "env-key"}) == "env-key"
    for flag, env, words in [
        ("", {}, "--api-key is empty"),
        (" key", {}, "whitespace"),
        ("key\n", {}, "whitespace"),
        (None, {"FLEETSERVE_API_KEY": ""}, "FLEETSERVE_API_KEY is empty"),
        (None, {"FLEETSERVE_API_KEY": "key "}, "whitespace"),
        ("ключ", {}, "ASCII"),
    ]:
        with pytest.raises(ValueError, match=words):
            api_key_from(flag, env)


def test_empty_api_key_refused_by_the_cli(tiny_llama: str) -> None:
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "serve", "--model", tiny_llama,
           "--port", "1", "--api-key", ""]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "--api-key is empty" in res.stderr


# 8. Spec and shapes.
def test_openapi_describes_request_bodies(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    for path, required in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]:
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        model = spec["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
        assert required in model["required"] and "max_tokens" in model["properties"]


def test_whole_number_floats_are_integers(http: httpx.Client) -> None:
    body = {"prompt": "hi", "n": 1.0, "max_tokens": 3.0, "seed": 7.0, "temperature": 1}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 3
    check_error(http.post("/v1/completions", json={"prompt": "hi", "n": 1.5}), 400, "n")
    chat = {"messages": CHAT, "max_completion_tokens": 2.0, "top_logprobs": 1.0, "logprobs": True}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_openapi_operation_ids_are_unique(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert "get" in spec["paths"]["/health"] and "head" not in spec["paths"]["/health"]


def test_head_health_and_live(http: httpx.Client) -> None:
    for path in ("/health", "/live", "/ready"):
        assert http.head(path).status_code == 200, path
        assert http.get(path).status_code == 200, path


def test_malformed_content_length_gets_json_error(srv: ServerProc) -> None:
    with _connect(srv) as s:
        s.sendall(f"{HEAD}Content-Length: 1x\r\n\r\n{{}}".encode())
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"application/json" in reply and b'"error"' in reply


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "web_search_options", {"search_context_size": "low"}),
        ("/v1/completions", "logit_bias", {"42": 5}),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ],
)
def test_unimplemented_fields_are_refused_by_name(
    http: httpx.Client, path: str, field: str, value: Any
) -> None:
    base: dict[str, Any] = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    err = check_error(http.post(path, json={**base, field: value}), 400, field)
    assert "not supported" in err["message"]


# 7. After the engine dies: no stale gauges or listed model; 503s say when to retry.
def test_dead_engine_state(tiny_llama: str) -> None:
    # Not replaced: the model stays down, and the server must say so everywhere.
    s = ServerProc(tiny_llama, "--max-num-seqs", "2", "--no-replace-failed").wait_ready()
    try:
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)  # running now
            assert s.core_pid is not None
            subprocess.run(["kill", "-9", str(s.core_pid)], check=True)
            list(lines)
        deadline = time.monotonic() + 10
        while httpx.get(f"{s.url}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        values = scrape(s.url)
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert metric(values, f"fleetserve:{gauge}") == 0, gauge
        assert httpx.get(f"{s.url}/v1/models").json()["data"] == []
        # Down for good (not replaced): liveness fails, so an orchestrator restarts it.
        live = httpx.get(f"{s.url}/live")
        assert live.status_code == 503 and live.json()["error"]["code"] == "dead"
        resp = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert resp.status_code == 503 and int(resp.headers["retry-after"]) > 0
    finally:
        s.stop()
