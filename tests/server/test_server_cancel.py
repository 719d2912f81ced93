"""Clients that vanish: their requests are aborted and their KV blocks freed."""

from __future__ import annotations

import asyncio
import time

import httpx
from server_proc import ServerProc, metric, scrape, wait_until

NUM_STREAMS = 36
NUM_NON_STREAMING = 6
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.8}


def engine_idle(url: str) -> bool:
    m = scrape(url)
    return (
        metric(m, "fleetserve:num_requests_running") == 0
        and metric(m, "fleetserve:num_requests_waiting") == 0
        and metric(m, "fleetserve:kv_cache_usage_perc") == 0
    )


def test_cancellation_storm(server: ServerProc) -> None:
    url = server.url
    aborted_before = metric(
        scrape(url), "fleetserve:request_success_total", finished_reason="abort"
    )

    async def stream_then_drop(ac: httpx.AsyncClient, i: int) -> int:
        if i % 2:
            path, body = "/v1/completions", {"prompt": f"The robot {i}", "stream": True, **LONG}
        else:
            msgs = [{"role": "user", "content": f"story {i}"}]
            path, body = "/v1/chat/completions", {"messages": msgs, "stream": True, **LONG}
        async with ac.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    return 1  # leaving the block closes the connection mid-stream
        return 0

    async def wait_then_drop(ac: httpx.AsyncClient, i: int) -> int:
        try:
            await ac.post("/v1/completions", json={"prompt": f"farmer {i}", **LONG}, timeout=1.0)
        except httpx.TimeoutException:
            return 1
        return 0

    async def storm() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            jobs = [stream_then_drop(ac, i) for i in range(NUM_STREAMS)]
            jobs += [wait_then_drop(ac, i) for i in range(NUM_NON_STREAMING)]
            return await asyncio.gather(*jobs)

    dropped = asyncio.run(asyncio.wait_for(storm(), 120))
    assert sum(dropped) == NUM_STREAMS + NUM_NON_STREAMING

    # A fresh request is answered promptly: nothing is left hogging the batch.
    t0 = time.monotonic()
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=30)
    assert resp.status_code == 200
    assert time.monotonic() - t0 < 10

    assert wait_until(lambda: engine_idle(url), timeout_s=10), scrape(url)
    aborted = metric(scrape(url), "fleetserve:request_success_total", finished_reason="abort")
    assert aborted - aborted_before == NUM_STREAMS + NUM_NON_STREAMING
