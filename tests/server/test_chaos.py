"""Chaos under streaming load: replicas killed (-9), SIGTERMed, hung (SIGSTOP) or drained
by the admin API while their requests stream; every stream must end exactly as in an
undisturbed run of the same requests (greedy and seeded sampling), with nothing lost,
repeated or double-billed. Only processes this test started are signalled, by pid."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_proc import ServerProc, metric, pid_alive, scrape, wait_until

from helpers import stream_completion

# Every engine step takes at least this long, so that streams are still running when a
# replica is taken away (the tiny model alone would finish them in a blink).
STEP_DELAY_S = "0.02"
MAX_TOKENS = 96


def requests(n: int) -> list[dict[str, Any]]:
    """Half greedy, half seeded sampling; different prompts, so the streams differ."""
    out = []
    for i in range(n):
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}
        out.append(
            {
                "prompt": f"request {i}: the fleet keeps serving",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                **sampling,
            }
        )
    return out


async def stream_one(c: openai.AsyncOpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: its text (the chunks joined), usage and finish reason."""
    extra = {"ignore_eos": body["ignore_eos"]}
    kwargs = {k: v for k, v in body.items() if k != "ignore_eos"}
    text, finish, usage, n = await stream_completion(c, model="tiny", extra_body=extra, **kwargs)
    return {"text": text, "finish": finish, "usage": usage, "chunks": n}


def run_streams(
    url: str, bodies: list[dict[str, Any]], during: Any = None, api_key: str = "x"
) -> list[Any]:
    """Streams every body at once; `during(url)` runs in a thread meanwhile (the chaos).
    Returns each stream's result or the exception it raised."""

    async def main() -> list[Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120
        ) as c:
            tasks = [asyncio.ensure_future(stream_one(c, b)) for b in bodies]
            if during is not None:
                await asyncio.to_thread(during, url)
            return await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=180
            )

    return asyncio.run(main())


def replicas(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/admin/replicas", timeout=10).json()["data"]


def ready_pids(url: str) -> list[int]:
    return [r["pid"] for r in replicas(url) if r["state"] == "ready"]


def busy_ready_pid(url: str) -> int:
    """The pid of a ready replica that holds requests now (waits for one)."""
    found: list[int] = []

    def pick() -> bool:
        found[:] = [r["pid"] for r in replicas(url) if r["state"] == "ready" and r["num_requests"]]
        return bool(found)

    assert wait_until(pick, 30), replicas(url)
    return found[0]


@pytest.fixture(scope="module")
def chaos_server(tiny_llama: str) -> Iterator[ServerProc]:
    srv = ServerProc(
        tiny_llama,
        "--served-model-name", "tiny", "-dp", "2", "--routing", "round_robin",
        "--hang-timeout", "3", "--sigterm-grace", "8", "--max-num-seqs", "16",
        env={"FLEETSERVE_DEBUG_STEP_DELAY_S": STEP_DELAY_S},
    )  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(chaos_server: ServerProc) -> list[dict[str, Any]]:
    """The undisturbed run: the same requests at once, with no chaos. (One at a time took
    8 x 96 steps at >= 0.02 s; the streams of a run are independent of their batch: the
    seeded ones draw from their own generators, and the chaos runs below batch them
    differently from this run, a replica's share changing as it dies.)"""
    out = run_streams(chaos_server.url, requests(8))
    for r in out:
        assert r["finish"] == "length" and r["usage"][1] == MAX_TOKENS, r
    return out


def check_identical(results: list[Any], reference: list[dict[str, Any]]) -> None:
    lost = [r for r in results if isinstance(r, BaseException)]
    assert not lost, lost
    for got, want in zip(results, reference, strict=True):
        assert got["text"] == want["text"]
        assert got["usage"] == want["usage"]  # billed once: prompt once, 96 tokens
        assert got["finish"] == "length"


def wait_two_ready(url: str) -> None:
    assert wait_until(lambda: len(ready_pids(url)) == 2, 120), replicas(url)


def test_kill9_replicas_under_load_loses_nothing(
    chaos_server: ServerProc, reference: list[dict[str, Any]]
) -> None:
    url = chaos_server.url
    migrated0 = metric(scrape(url), "fleetserve:request_migrations_total")
    kills: list[int] = []

    def kill_one(url: str) -> None:
        pid = busy_ready_pid(url)
        os.kill(pid, signal.SIGKILL)
        kills.append(pid)
        # Noticed within 2 s: it leaves the replica list (a replacement is started).
        assert wait_until(lambda: pid not in [r["pid"] for r in replicas(url)], 2.5)

    for _ in range(3):  # K = 3 kills, each of a replica that is streaming
        wait_two_ready(url)
        results = run_streams(url, requests(8), during=kill_one)
        check_identical(results, reference)
    assert len(kills) == 3 and not any(pid_alive(p) for p in kills)
    values = scrape(url)
    assert metric(values, "fleetserve:request_migrations_total") - migrated0 >= 3
    assert metric(values, "fleetserve:replica_events_total", event="failed") >= 3


def test_sigterm_replica_drains_inside_budget(
    chaos_server: ServerProc, reference: list[dict[str, Any]]
) -> None:
    url = chaos_server.url
    wait_two_ready(url)
    gone: dict[str, float] = {}

    def chaos(url: str) -> None:
        pid = busy_ready_pid(url)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)  # what Kubernetes sends; grace 8 s here
        assert wait_until(lambda: not pid_alive(pid), 15)
        gone["s"] = time.monotonic() - t0

    results = run_streams(url, requests(8), during=chaos)
    check_identical(results, reference)
    assert gone["s"] < 8.0  # handed over and exited before its own deadline
    assert metric(scrape(url), "fleetserve:replica_events_total", event="notice") >= 1


def test_hung_replica_is_replaced(
    chaos_server: ServerProc, reference: list[dict[str, Any]]
) -> None:
    url = chaos_server.url
    wait_two_ready(url)
    stopped: list[int] = []

    def chaos(url: str) -> None:
        pid = busy_ready_pid(url)
        os.kill(pid, signal.SIGSTOP)  # alive, but no step progress: a hang
        stopped.append(pid)
        assert wait_until(lambda: not pid_alive(pid), 15)  # declared hung (3 s), killed

    try:
        results = run_streams(url, requests(8), during=chaos)
    finally:
        for pid in stopped:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    check_identical(results, reference)
    assert metric(scrape(url), "fleetserve:replica_events_total", event="hung") >= 1


def test_admin_drain_moves_requests(
    chaos_server: ServerProc, reference: list[dict[str, Any]]
) -> None:
    url = chaos_server.url
    wait_two_ready(url)
    bad = httpx.post(f"{url}/admin/replicas/tiny:99/drain", timeout=10)
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "replica_id"
    bad = httpx.post(f"{url}/admin/replicas/tiny:0/drain", json={"timeout_s": -1}, timeout=10)
    assert bad.status_code in (400, 404), bad.text

    def chaos(url: str) -> None:
        found: list[str] = []

        def pick() -> bool:
            found[:] = [
                r["id"] for r in replicas(url) if r["state"] == "ready" and r["num_requests"]
            ]
            return bool(found)

        assert wait_until(pick, 30)
        resp = httpx.post(f"{url}/admin/replicas/{found[0]}/drain", json={"timeout_s": 0.5})
        assert resp.status_code == 202, resp.text
        again = httpx.post(f"{url}/admin/replicas/{found[0]}/drain", timeout=10)
        assert again.status_code in (409, 404), again.text  # draining, or already gone
        assert wait_until(lambda: found[0] not in [r["id"] for r in replicas(url)], 15)

    results = run_streams(url, requests(8), during=chaos)
    check_identical(results, reference)
