"""A request's own deadline (X-Fleetserve-Deadline-Ms): past it the client gets a 504 with
the OpenAI error body (in a started stream, the error chunk), the engine request is
aborted, and the requests beside it are answered as usual."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
from server_proc import ServerProc, metric, scrape, wait_until

HEADER = "X-Fleetserve-Deadline-Ms"
# Far more work than a few hundred ms of a tiny model on this machine.
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.8}


def aborted(url: str) -> float:
    return metric(scrape(url), "fleetserve:request_success_total", finished_reason="abort")


def idle(url: str) -> bool:
    m = scrape(url)
    return metric(m, "fleetserve:num_requests_running") == 0


def test_a_bad_deadline_is_a_400_naming_the_header(server: ServerProc) -> None:
    for value in ("soon", "0", "-5", "nan"):
        resp = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers={HEADER: value},
            timeout=30,
        )
        assert resp.status_code == 400, value
        assert resp.json()["error"]["param"] == HEADER


def test_a_generous_deadline_changes_nothing(server: ServerProc) -> None:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    kw = {"model": "tiny", "prompt": "The sea", "max_tokens": 6, "temperature": 0.0}
    plain = c.completions.create(**kw)  # type: ignore[call-overload]
    bounded = c.completions.create(**kw, extra_headers={HEADER: "60000"})  # type: ignore[call-overload]
    assert bounded.choices[0].text == plain.choices[0].text


def test_past_the_deadline_504_and_the_engine_request_is_aborted(server: ServerProc) -> None:
    url = server.url
    # The session server's earlier requests (other modules of its unit) ended and counted.
    assert wait_until(lambda: idle(url), timeout_s=10)
    before = aborted(url)

    async def run() -> tuple[httpx.Response, list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            late = ac.post("/v1/completions", json={"prompt": "a", **LONG}, headers={HEADER: "300"})
            msgs = [{"role": "user", "content": "a story"}]

            async def stream() -> list[str]:
                body = {"messages": msgs, "stream": True, **LONG}
                async with ac.stream(
                    "POST", "/v1/chat/completions", json=body, headers={HEADER: "300"}
                ) as resp:
                    assert resp.status_code == 200
                    return [line async for line in resp.aiter_lines() if line.startswith("data:")]

            # A request beside them, without a deadline, is answered whole.
            # (ignore_eos: sampled, it could otherwise stop at EOS before 30 tokens)
            beside = ac.post(
                "/v1/completions", json={"prompt": "b", "max_tokens": 30, "ignore_eos": True}
            )
            return await asyncio.gather(late, stream(), beside)

    late, lines, beside = asyncio.run(run())
    assert late.status_code == 504, late.text
    err = late.json()["error"]
    assert err["code"] == "deadline_exceeded" and err["type"] == "server_error"
    assert HEADER in err["message"]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["error"]["code"] == "deadline_exceeded"
    assert beside.status_code == 200
    assert beside.json()["usage"]["completion_tokens"] == 30
    assert wait_until(lambda: aborted(url) - before == 2, timeout_s=10)
    assert wait_until(lambda: idle(url), timeout_s=10)
