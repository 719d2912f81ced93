"""A model's spot and on-demand pools on a simulated cluster: one worker node has the
`spot` resource, the other the node label market=on-demand (both ways of placing a pool). Each pool's replicas land on its node; removing
the spot node under streaming load loses no request (the streams resume on the
on-demand replica, each identical to an undisturbed run), on-demand fallback replicas
appear and serve; a spot node joining again takes the spot replica back and the
fallback is given back. The pieces without a cluster: test_ray_pools.py."""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from ray_cluster import add_worker, ray_cluster, replica_nodes, wait_healthy, wait_until

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

PROMPT = "The quick brown fox"
STEP_DELAY_S = "0.05"
SPOT, BASE = "model-tiny--spot", "model-tiny--base"
MAX_TOKENS = 100  # long enough that the node's removal falls mid-stream
SHORT_TOKENS = 20  # where a stream only has to be served whole and right


def fleet_config(model: str) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "tiny",
                "model": model,
                "pools": [
                    {"name": "spot", "capacity": "spot", "replicas": 1},
                    {"name": "base", "capacity": "on_demand", "replicas": 1, "max_fallback": 1},
                ],
                "engine": {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 256},
                "placement": {
                    "num_cpus": 1,
                    "spot_pending_s": 2,
                    "on_demand_labels": {"market": "on-demand"},
                },
            }
        ]
    }


@pytest.fixture(scope="module")
def pools_fleet(tiny_llama: str) -> Iterator[tuple[Any, str]]:
    from fleetserve.ray import build_app

    with ray_cluster(
        env={"FLEETSERVE_DEBUG_STEP_DELAY_S": STEP_DELAY_S},
        worker_resources=[{"spot": 1}],
        worker_labels=[{}, {"market": "on-demand"}],
    ) as (cluster, base_url):
        serve.run(build_app(fleet_config(tiny_llama)), name="fleetserve", route_prefix="/")
        wait_healthy(base_url)
        yield cluster, base_url


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


def replica_metric(base_url: str, name: str) -> dict[str, float]:
    """replica label -> value of fleetserve:<name> for model tiny."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = re.compile(
        rf'^fleetserve:{name}(?:_total)?{{model_name="tiny",replica="([^"]+)"}} (\S+)$', re.M
    )
    return {label: float(value) for label, value in pattern.findall(text)}


def worker_with(cluster: Any, has: Callable[[dict[str, Any]], bool]) -> Any:
    """The cluster's worker node (for remove_node) whose ray.nodes() entry has it."""
    (node_id,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and has(n)]
    return next(node for node in cluster.worker_nodes if node.node_id == node_id)


def stream(c: openai.OpenAI, max_tokens: int = MAX_TOKENS) -> str:
    try:
        return "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            if ch.choices
        )
    except openai.APIError as e:
        return f"error: {e}"


def test_spot_loss_falls_back_to_on_demand_and_back(pools_fleet: tuple[Any, str]) -> None:
    cluster, base_url = pools_fleet
    spot_node = worker_with(cluster, lambda n: "spot" in n["Resources"])
    base_node = worker_with(cluster, lambda n: n["Labels"].get("market") == "on-demand")
    wait_until(lambda: replica_nodes(SPOT) == [spot_node.node_id], 120, "spot on its node")
    wait_until(lambda: replica_nodes(BASE) == [base_node.node_id], 120, "base on its node")
    c = client(base_url)
    want = stream(c)  # undisturbed, on the spot replica (spot first)
    assert len(want) > 0 and not want.startswith("error")
    want_short = stream(c, SHORT_TOKENS)
    assert len(want_short) > 0 and not want_short.startswith("error")
    spot_queries = replica_metric(base_url, "replica_prefix_cache_queries")
    assert set(spot_queries) >= {"spot-0"}, spot_queries

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, c) for _ in range(6)]
        # Spot first: up to a batch (max_num_seqs 4) on spot, the rest on on-demand.
        wait_until(
            lambda: replica_metric(base_url, "replica_outstanding_requests").get("spot-0", 0) > 0,
            30,
            "requests on the spot replica",
            every_s=0.1,
        )
        time.sleep(1.0)
        removed_at = time.monotonic()
        cluster.remove_node(spot_node)  # the spot node is preempted
        done, not_done = concurrent.futures.wait(futures, timeout=120)
    assert not not_done, f"{len(not_done)} requests still open 120 s after the spot node left"
    results = [f.result() for f in done]
    # No request lost, no token lost or repeated: each equals the undisturbed stream.
    assert results == [want] * 6, [r[:200] for r in results if r != want]

    # Spot cannot be placed (no node has `spot`): a fallback on-demand replica appears...
    wait_until(lambda: len(replica_nodes(BASE)) == 2, 120, "a fallback on-demand replica")
    fallback_s = time.monotonic() - removed_at
    assert replica_nodes(BASE) == [base_node.node_id] * 2
    assert replica_nodes(SPOT) == []

    # ... and serves: concurrent requests spread over both on-demand replicas.
    def both_served() -> bool:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda _: stream(c, SHORT_TOKENS), range(8))) == [want_short] * 8
        queries = replica_metric(base_url, "replica_prefix_cache_queries")
        return sum(1 for k, v in queries.items() if k.startswith("base-") and v > 0) >= 2

    wait_until(both_served, 120, "both on-demand replicas to serve", every_s=1.0)

    # A spot node joins again: spot runs there and the fallback is given back.
    added_at = time.monotonic()
    new_spot = add_worker(cluster, 2, {"spot": 1})
    wait_until(lambda: replica_nodes(SPOT) == [new_spot.node_id], 180, "spot back on its node")
    spot_s = time.monotonic() - added_at
    wait_until(lambda: len(replica_nodes(BASE)) == 1, 120, "the fallback given back")
    print(
        f"spot node removed -> fallback replica alive: {fallback_s:.1f} s; spot node added "
        f"-> spot replica alive: {spot_s:.1f} s -> fallback gone: "
        f"{time.monotonic() - added_at:.1f} s"
    )
    assert stream(c, SHORT_TOKENS) == want_short
