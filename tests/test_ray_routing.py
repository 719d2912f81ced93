"""fleetserve's routing policies inside Ray Serve (FleetRequestRouter): with prefix affinity
the requests that share a prompt prefix go to the replica that cached it, on whatever node,
so the fleet's prefix-cache hit rate beats round robin's on the same requests. Hit rates
come from the ingress's /metrics (the replicas' own counters, via their routing stats).
One app serves the same checkpoint twice, once per policy (two deployments of two
replicas each, one replica of each per node), so one deployment start serves both."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ray_cluster import ray_cluster, scrape, wait_healthy

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

# Three documents of a few full KV blocks each; every request asks about one of them, in
# turn, so that round robin over two replicas sends each document to both.
DOCS = [
    " ".join(f"{a}{i} {b}{i} {c}{i}" for i in range(24))
    for a, b, c in (
        ("alpha", "beta", "gamma"),
        ("delta", "omega", "sigma"),
        ("red", "green", "blue"),
    )
]
NUM_PER_DOC = 4


POLICIES = {"rr": "round_robin", "pa": "prefix_affinity"}


def fleet(model: str) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": name,
                "model": model,
                "replicas": 2,
                "routing": routing,
                "engine": {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 512},
                "placement": {"num_cpus": 1, "max_replicas_per_node": 1},
            }
            for name, routing in POLICIES.items()
        ]
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, str]]:
    with ray_cluster() as c:
        yield c


def per_replica(text: str, name: str, model: str) -> dict[str, float]:
    pattern = rf'^fleetserve:{name}{{model_name="{model}",replica="(\d+)"}} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


def run_workload(base_url: str, model: str) -> tuple[dict[str, float], dict[str, float]]:
    """Sends every request one after another; the replicas' (queries, hits) once their
    routing stats (every second) have caught up."""
    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)
    for i in range(NUM_PER_DOC):
        for doc in DOCS:
            c.completions.create(
                model=model, prompt=f"{doc} question {i}:", max_tokens=2, temperature=0
            )
    last: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for _ in range(30):
        text = scrape(base_url)
        now = (per_replica(text, "replica_prefix_cache_queries_total", model),
               per_replica(text, "replica_prefix_cache_hits_total", model))  # fmt: skip
        if now == last and sum(now[0].values()) > 0:
            return now
        last = now
        time.sleep(1.5)
    return last


def hit_rate(queries: dict[str, float], hits: dict[str, float]) -> float:
    return sum(hits.values()) / sum(queries.values())


def test_prefix_affinity_beats_round_robin_across_nodes(
    cluster: tuple[Any, str], tiny_llama: str
) -> None:
    from fleetserve.ray import build_app

    _, base_url = cluster
    rates = {}
    serve.run(build_app(fleet(tiny_llama)), name="fleetserve", route_prefix="/")
    try:
        wait_healthy(base_url)
        for model, routing in POLICIES.items():
            queries, hits = run_workload(base_url, model)
            assert len(queries) == 2, queries  # both replicas reported
            rates[routing] = hit_rate(queries, hits)
            used = [r for r, q in queries.items() if q > 0]
            if routing == "round_robin":
                assert len(used) == 2, queries
            else:
                # Every request of a document followed its first to the replica holding
                # it; all were idle then, and ties go to the lowest index: one replica
                # took all.
                assert len(used) == 1, queries
            outstanding = per_replica(scrape(base_url), "replica_outstanding_requests", model)
            assert set(outstanding.values()) == {0.0}, outstanding  # the router's bookkeeping
    finally:
        serve.delete("fleetserve")
    print(f"prefix-cache hit rate: {rates}")
    assert rates["prefix_affinity"] > rates["round_robin"]
