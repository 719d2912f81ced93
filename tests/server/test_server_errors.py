"""Bad input, auth and overload, answered with the right status and OpenAI's error body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_proc import ServerProc, metric, scrape, wait_until

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 2048
MAX_BYTES = 16384
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tiny_llama: str) -> Iterator[ServerProc]:
    s = ServerProc(
        tiny_llama,
        "--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_BYTES),
        "--max-num-seqs", "1", "--max-waiting-requests", "2",
        env={"FLEETSERVE_API_KEY": KEY},
    )  # fmt: skip
    try:
        yield s.wait_ready()
    finally:
        code = s.stop()
        assert code == 0, s.final_output


@pytest.fixture(scope="module")
def http(srv: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        yield c


def check_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


LONG_PROMPT = "the cat " * 1100  # over MAX_MODEL_LEN tokens, under the body limit

BAD_COMPLETIONS: list[tuple[dict[str, Any], str | None]] = [
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": LONG_PROMPT}, "prompt"),
    ({"prompt": "hello", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "stream": True, "temperature": -1}, "temperature"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=lambda v: json.dumps(v)[:40])
def test_bad_completion(http: httpx.Client, body: dict[str, Any], param: str | None) -> None:
    check_error(http.post("/v1/completions", json=body), 400, param)


BAD_CHAT: list[tuple[dict[str, Any], str | None]] = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, "prompt"),
    ({"messages": CHAT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"messages": CHAT, "stream": True, "n": 0}, "n"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=lambda v: json.dumps(v)[:40])
def test_bad_chat(http: httpx.Client, body: dict[str, Any], param: str | None) -> None:
    check_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ',
        b"[1, 2]",
        b'"text"',
        b"null",
        b"\xff\xfe",
        b'{"prompt": "x", "temperature": NaN}',
    ],
)
def test_malformed_body(http: httpx.Client, path: str, raw: bytes) -> None:
    resp = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    check_error(resp, 400)


def test_unknown_model(http: httpx.Client) -> None:
    check_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    body = {"model": "gpt-9", "messages": CHAT}
    check_error(http.post("/v1/chat/completions", json=body), 404, "model")


def test_body_too_large(http: httpx.Client) -> None:
    body = {"prompt": "x" * (MAX_BYTES + 10)}
    check_error(http.post("/v1/completions", json=body), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 1000 + 1):
            yield b"y" * 1000
        yield b'"}'

    json_type = {"Content-Type": "application/json"}
    check_error(http.post("/v1/completions", content=chunks(), headers=json_type), 413)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    check_error(http.get("/v1/nope"), 404)
    check_error(http.get("/v1/completions"), 405)


def test_auth(srv: ServerProc) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            check_error(c.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            check_error(c.get("/v1/models", headers=headers), 401)
            check_error(c.get("/metrics", headers=headers), 401)
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        assert c.get("/v1/models", headers=AUTH).status_code == 200


def test_overload_gives_503_with_retry_after(srv: ServerProc) -> None:
    """max_num_seqs=1, max_waiting_requests=2: of a burst, one runs, two wait, the rest are
    refused at once (the accepted ones take far longer than the burst takes to arrive)."""
    body = {"prompt": "the cat", "max_tokens": 120, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as ac:
            return await asyncio.gather(*[ac.post("/v1/completions", json=body) for _ in range(8)])

    responses = asyncio.run(asyncio.wait_for(main(), 90))
    refused = [r for r in responses if r.status_code == 503]
    accepted = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(accepted) == len(responses)
    assert 1 <= len(accepted) <= 4 and len(refused) >= 4
    for r in refused:
        assert check_error(r, 503)["code"] == "overloaded"
        assert r.headers["Retry-After"].isdigit()


def test_queued_client_that_leaves_is_aborted(srv: ServerProc) -> None:
    """max_num_seqs=1: B waits behind A and has sent no byte yet when its client leaves."""
    long = {"prompt": "the cat", "max_tokens": 2000, "ignore_eos": True, "stream": True}

    def waiting() -> float:
        return metric(scrape(srv.url, AUTH), "fleetserve:num_requests_waiting")

    async def main() -> None:
        async with (
            httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as ac,
            ac.stream("POST", "/v1/completions", json=long) as a,
        ):
            lines = a.aiter_lines()
            await lines.__anext__()
            b = asyncio.create_task(ac.post("/v1/completions", json=long))
            assert await asyncio.to_thread(wait_until, lambda: waiting() == 1, 10)
            b.cancel()
            await asyncio.gather(b, return_exceptions=True)
            assert await asyncio.to_thread(wait_until, lambda: waiting() == 0, 5)
            # A is still running all along.
            assert metric(scrape(srv.url, AUTH), "fleetserve:num_requests_running") == 1

    asyncio.run(asyncio.wait_for(main(), 60))


def test_still_serving_after_bad_input(http: httpx.Client) -> None:
    """Runs last in this module: nothing above hurt the engine."""
    resp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
