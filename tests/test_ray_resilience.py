"""Fleet III's hang detection, SIGTERM drain and hedging on a simulated Ray cluster (one
module cluster: a head and two workers, the second slowed to 2 s per engine step).

- A Ray replica whose engine process is stopped (SIGSTOP: hung, not dead) under streams:
  within hang_timeout_s its streams move to the other replica and end exactly as an
  undisturbed run; Serve replaces the replica.
- SIGTERM to a Ray replica's engine process: the replica drains as a local one does
  (requests that would not finish in its window move at once, new ones go elsewhere),
  nothing is lost, the engine is gone by its deadline and Serve replaces the replica.
- Hedging: a class with hedge_after_s whose requests land on the slow replica get a copy
  on the fast one, which wins; every stream (text, usage) equals the unhedged run, and the
  slow replica's engine drops the losers at once.

Only processes this test started are signalled, by pid (and resumed / killed in a
finally)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from helpers import stream_completion
from ray_cluster import (
    engine_core_pid,
    pid_alive,
    ray_cluster,
    replica_pids,
    wait_healthy,
    wait_until,
)

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

API_KEY = "ray-resilience-key"
HANG_TIMEOUT_S = 3.0
SIGTERM_GRACE_S = 5.0
SLOW_STEP_S = 2.0  # the slow worker's engines
HEDGE_AFTER_S = 0.5
NUM_TOKENS = 64


def fleet_config(model: str) -> dict[str, Any]:
    engine = {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 256}
    return {
        "models": [
            {
                # Both replicas on the fast worker (its custom resource): hang and SIGTERM.
                "name": "tiny",
                "model": model,
                "replicas": 2,
                # Round robin: 8 streams sent at once split 4 + 4. (least_loaded sees
                # equal loads when Serve routes them together and may put all on one.)
                "routing": "round_robin",
                "engine": engine,
                "placement": {"num_cpus": 1, "resources": {"fast": 0.01}},
                "resilience": {
                    "hang_timeout_s": HANG_TIMEOUT_S,
                    "sigterm_grace_s": SIGTERM_GRACE_S,
                },
            },
            {
                # One replica per worker: the slow one and a fast one. Round robin, so
                # that some requests go to the slow one first.
                "name": "hedged",
                "model": model,
                "replicas": 2,
                "routing": "round_robin",
                "engine": engine,
                "placement": {"num_cpus": 1, "max_replicas_per_node": 1},
                "resilience": {"hang_timeout_s": 60.0},
            },
        ],
        "classes": {
            "interactive": {"priority": 0},
            "hedged": {"priority": 0, "hedge_after_s": HEDGE_AFTER_S},
        },
        "default_class": "interactive",
    }


@pytest.fixture(scope="module")
def fleet(tiny_llama: str) -> Iterator[str]:
    from fleetserve.ray import IngressOptions, build_app

    with ray_cluster(
        # Paced steps on the fast worker, so that streams are under way when signalled.
        worker_resources=[{"CPU": 3, "fast": 1}, {"CPU": 1}],
        worker_env=[
            {"FLEETSERVE_DEBUG_STEP_DELAY_S": "0.05"},
            {"FLEETSERVE_DEBUG_STEP_DELAY_S": str(SLOW_STEP_S)},
        ],
    ) as (_, base_url):
        app = build_app(fleet_config(tiny_llama), IngressOptions(api_key=API_KEY))
        serve.run(app, name="fleetserve", route_prefix="/")
        wait_healthy(base_url)
        yield base_url


# ------------------------------------------------------------------ helpers


def bodies(n: int, max_tokens: int = NUM_TOKENS) -> list[dict[str, Any]]:
    """Half greedy, half seeded sampling; different prompts, so the streams differ."""
    return [
        {
            "prompt": f"The quick brown fox {i}: the fleet keeps serving",
            "max_tokens": max_tokens,
            **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}),
        }
        for i in range(n)
    ]


async def stream_one(
    c: openai.AsyncOpenAI, model: str, body: dict[str, Any], cls: str
) -> dict[str, Any]:
    """One streamed completion: its text (the chunks joined), usage and finish reason."""
    text, finish, usage, _ = await stream_completion(
        c, model=model, extra_body={"ignore_eos": True},
        extra_headers={"X-Fleetserve-Class": cls}, **body,
    )  # fmt: skip
    return {"text": text, "finish": finish, "usage": usage, "end": time.monotonic()}


def run_streams(
    base_url: str,
    model: str,
    bodies: list[dict[str, Any]],
    cls: str = "interactive",
    during: Callable[[], None] | None = None,
) -> list[Any]:
    """Streams every body at once; `during()` runs in a thread meanwhile (the chaos).
    Each stream's result, or the exception it raised."""

    async def main() -> list[Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=180
        ) as c:
            tasks = [asyncio.ensure_future(stream_one(c, model, b, cls)) for b in bodies]
            if during is not None:
                await asyncio.to_thread(during)
            return await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=300
            )

    return asyncio.run(main())


def same(got: list[Any], want: list[Any]) -> None:
    failed = [r for r in got if isinstance(r, BaseException)]
    assert not failed, failed
    for g, w in zip(got, want, strict=True):
        # Same text, billed once (prompt once, every token once), same finish.
        assert (g["text"], g["usage"], g["finish"]) == (w["text"], w["usage"], w["finish"])


def series(base_url: str, prefix: str) -> list[float]:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]


def migrations(base_url: str, reason: str) -> float:
    prefix = f'fleetserve:request_migrations_total{{model_name="tiny",reason="{reason}"}}'
    return sum(series(base_url, prefix))


def outstanding_per_replica(base_url: str, model: str) -> list[float]:
    """Calls the ingress's router has on each replica of `model`."""
    return series(base_url, f'fleetserve:replica_outstanding_requests{{model_name="{model}"')


def running(model: str) -> int:
    status = serve.status().applications["fleetserve"].deployments[f"model-{model}"]
    return int(status.replica_states.get("RUNNING", 0))


def busy_engine(base_url: str, before: dict[str, int]) -> int:
    """Once both replicas of 'tiny' hold streams: the engine process of one of them."""
    seen: list[float] = []

    def both_busy() -> bool:
        # The router's series of each replica it has routed to: a replaced replica's may
        # linger beside its successor's, so count the busy ones rather than all of them.
        seen[:] = outstanding_per_replica(base_url, "tiny")
        return sum(1 for n in seen if n >= 1) >= 2

    try:
        wait_until(both_busy, 60, "both replicas holding streams", 0.1)
    except AssertionError as e:
        text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        lines = [x for x in text.text.splitlines() if "replica_" in x and "tiny" in x]
        raise AssertionError(f"{e}; last seen {seen}; {lines}") from None
    return engine_core_pid(before[min(before)])


def replaced(before: dict[str, int]) -> None:
    wait_until(
        lambda: bool(replica_pids("model-tiny").keys() - before.keys()) and running("tiny") == 2,
        240,
        "Serve to replace the replica",
    )


# ------------------------------------------------------------------ tests


def test_a_hung_engine_s_streams_move_within_hang_timeout_s(fleet: str) -> None:
    base_url = fleet
    work = bodies(8)
    reference = run_streams(base_url, "tiny", work)
    for r in reference:
        assert isinstance(r, dict) and r["usage"][1] == NUM_TOKENS, r
    before = replica_pids("model-tiny")
    hung0 = migrations(base_url, "hung")
    seen: dict[str, float] = {}

    def hang_a_busy_engine() -> None:
        pid = busy_engine(base_url, before)
        seen["pid"] = pid
        os.kill(pid, signal.SIGSTOP)
        seen["stopped_at"] = time.monotonic()
        wait_until(lambda: migrations(base_url, "hung") > hung0, 60, "the hang to be seen", 0.1)
        seen["moved_at"] = time.monotonic()

    try:
        results = run_streams(base_url, "tiny", work, during=hang_a_busy_engine)
    finally:
        if "pid" in seen:  # the replica kills it; if not, it must not outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(seen["pid"], signal.SIGCONT)
                os.kill(seen["pid"], signal.SIGKILL)
    same(results, reference)
    # Seen within hang_timeout_s (+ the watch's 0.25 s period and the metrics' path), not
    # after Serve's health-check period: every stream of the hung engine moved.
    detect_s = seen["moved_at"] - seen["stopped_at"]
    print(f"hung engine: its streams moved {detect_s:.1f} s after SIGSTOP")
    assert HANG_TIMEOUT_S - 0.5 <= detect_s <= HANG_TIMEOUT_S + 3.0, detect_s
    # Serve replaces the replica (its health check fails) and the hung process is gone.
    wait_until(lambda: not pid_alive(seen["pid"]), 30, "the hung engine to be killed")
    replaced(before)


def test_sigterm_drains_a_ray_replica_and_loses_nothing(fleet: str) -> None:
    base_url = fleet
    work = bodies(8)
    late = bodies(4, max_tokens=16)
    reference = run_streams(base_url, "tiny", work)
    late_reference = run_streams(base_url, "tiny", late)
    before = replica_pids("model-tiny")
    drained0 = migrations(base_url, "drained")
    seen: dict[str, Any] = {}

    def sigterm_a_busy_engine() -> None:
        pid = busy_engine(base_url, before)
        seen["pid"] = pid
        os.kill(pid, signal.SIGTERM)
        seen["at"] = time.monotonic()
        watch = threading.Thread(target=time_the_exit, args=(pid,))
        watch.start()
        time.sleep(1.0)
        # Sent while the replica drains: served elsewhere, nothing refused.
        seen["late"] = run_streams(base_url, "tiny", late)
        watch.join()

    def time_the_exit(pid: int) -> None:
        wait_until(lambda: not pid_alive(pid), SIGTERM_GRACE_S + 30, "the engine to exit", 0.1)
        seen["exited_after_s"] = time.monotonic() - seen["at"]

    try:
        results = run_streams(base_url, "tiny", work, during=sigterm_a_busy_engine)
    finally:
        if "pid" in seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(seen["pid"], signal.SIGKILL)
    same(results, reference)
    same(seen["late"], late_reference)
    # Streams that could not finish in the drain window (grace - the notice margin) moved.
    assert migrations(base_url, "drained") > drained0
    # Gone by its deadline (the core exits then at the latest; + its idle poll and exit).
    print(f"SIGTERM: the engine exited {seen['exited_after_s']:.1f} s after the notice")
    assert seen["exited_after_s"] <= SIGTERM_GRACE_S + 2.0
    replaced(before)


def test_hedged_requests_on_the_slow_replica_are_won_by_a_copy(fleet: str) -> None:
    base_url = fleet
    work = bodies(4, max_tokens=8)
    reference = run_streams(base_url, "hedged", work)  # the unhedged class
    hedges0 = {w: hedges(base_url, w) for w in ("first", "copy")}

    results = run_streams(base_url, "hedged", work, cls="hedged")
    same(results, reference)
    ended = max(r["end"] for r in results)
    won = {w: hedges(base_url, w) - hedges0[w] for w in ("first", "copy")}
    print(f"hedges by winner: {won}")
    # Round robin sent half of them to the slow replica first; their copies won.
    assert won["copy"] >= 1, won
    # The losers were aborted in the slow engine: it is idle at once, where a loser left
    # running would keep it busy for 8 steps of 2 s.
    wait_until(
        lambda: (
            sum(series(base_url, 'fleetserve:replica_num_requests_running{model_name="hedged"'))
            + sum(series(base_url, 'fleetserve:replica_num_requests_waiting{model_name="hedged"'))
            == 0
        ),
        30,
        "the hedged replicas to be idle",
        every_s=0.2,
    )
    idle_after_s = time.monotonic() - ended
    print(f"hedging: both replicas idle {idle_after_s:.1f} s after the last stream ended")
    assert idle_after_s < 3 * SLOW_STEP_S


def hedges(base_url: str, winner: str) -> float:
    prefix = f'fleetserve:request_hedges_total{{model_name="hedged",winner="{winner}"}}'
    return sum(series(base_url, prefix))
