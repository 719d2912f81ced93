"""Adapter-aware routing on Ray Serve (ray/request_router.py): a LoRA request goes to a
replica that holds its adapter (reported in the replica's routing stats, or sent there
by this router), within the load bound; one that no replica holds goes to the least
loaded, which loads it. Unit tests of the router with Serve's objects stood in for, and
(slow) a real Ray cluster: round robin alternates base requests over two replicas while
every request of one adapter stays on one replica."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fleetserve.core.lora_request import LoRARequest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


def _router(name: str, policy: str, imbalance_tokens: int = 2048) -> Any:
    from fleetserve.ray.request_router import FleetRequestRouter

    router = FleetRequestRouter.__new__(FleetRequestRouter)  # Serve's setup is not needed
    router._deployment_id = SimpleNamespace(name=name)  # type: ignore[assignment]
    router.initialize_state(policy=policy, imbalance_tokens=imbalance_tokens)
    return router


def _pending(i: int, lora: str | None, tokens: int = 8) -> Any:
    kw: dict[str, Any] = {"request_id": f"q{i}", "prompt": {"prompt_token_ids": [1, 2]},
                          "num_new_tokens": tokens}  # fmt: skip
    if lora is not None:
        kw["lora"] = LoRARequest(lora, 1, "/adapters/" + lora)
    return SimpleNamespace(kwargs=kw, metadata=SimpleNamespace(internal_request_id=f"h{i}"))


def _pick(router: Any, replicas: list[Any], pending: Any) -> str:
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return str(ranks[0][0].replica_id)


def test_the_router_prefers_the_replica_holding_the_adapter() -> None:
    from fleetserve.ray import router_state

    router = _router("lora-route-test", "round_robin")
    try:
        r0 = SimpleNamespace(replica_id="r0", routing_stats={"lora_adapters": []})
        r1 = SimpleNamespace(replica_id="r1", routing_stats={"lora_adapters": ["x"]})
        replicas = [r0, r1]
        # Base requests: round robin over both.
        assert {_pick(router, replicas, _pending(i, None)) for i in range(4)} == {"r0", "r1"}
        # Requests of x: always its holder.
        assert {_pick(router, replicas, _pending(10 + i, "x")) for i in range(4)} == {"r1"}
        # y is held nowhere: the least loaded takes it (r0: r1 has x's 4 reservations), and
        # y's later requests follow it there before its stats list y.
        assert _pick(router, replicas, _pending(20, "y")) == "r0"
        assert {_pick(router, replicas, _pending(21 + i, "y")) for i in range(3)} == {"r0"}
        # Once the stats list y, the router's own note of it is dropped (no double count).
        r0.routing_stats = {"lora_adapters": ["y"]}
        view = router._views["r0"]
        assert view.lora_names == frozenset({"y"}) and view.routed_loras == frozenset()
        assert _pick(router, replicas, _pending(30, "y")) == "r0"
    finally:
        router_state.ROUTERS.pop("lora-route-test", None)


def test_a_holder_past_the_load_bound_is_passed_over() -> None:
    from fleetserve.ray import router_state

    router = _router("lora-bound-test", "least_loaded", imbalance_tokens=100)
    try:
        r0 = SimpleNamespace(replica_id="r0", routing_stats={"lora_adapters": ["x"]})
        r1 = SimpleNamespace(replica_id="r1", routing_stats={})
        replicas = [r0, r1]
        # A big base request lands on r0 (least loaded, lowest index): r0 is now 1,002
        # tokens ahead of r1, past the bound, so x's request goes to r1, which loads x.
        assert _pick(router, replicas, _pending(0, None, tokens=1000)) == "r0"
        assert _pick(router, replicas, _pending(1, "x")) == "r1"
        assert "x" in router._views["r1"].lora_names
    finally:
        router_state.ROUTERS.pop("lora-bound-test", None)


# ----------------------------------------------------------------- real Ray cluster
def _fleet(model: str, adapters: dict[str, str]) -> dict[str, Any]:
    """Two replicas, round robin; one adapter kept per engine (each preloads the first)."""
    return {
        "models": [
            {
                "name": "tiny",
                "model": model,
                "replicas": 2,
                "routing": "round_robin",
                "adapters": adapters,
                "engine": {
                    "max_num_seqs": 4,
                    "num_threads": 1,
                    "max_model_len": 256,
                    "max_lora_rank": 8,
                    "max_loras": 1,
                    "max_cpu_loras": 1,
                },  # fmt: skip
                "placement": {"num_cpus": 1, "max_replicas_per_node": 1},
            }
        ]
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, str]]:
    from ray_cluster import ray_cluster

    with ray_cluster() as c:
        yield c


def _queries(base_url: str, sent: bool = True) -> dict[str, float]:
    """Prefix-cache queries per replica (every request makes some) once the replicas'
    routing stats (every second) have caught up: two reads in a row agree (and, once
    requests were `sent`, count some; before any, zero counts are the answer and waiting
    for more only ran out the 45 s)."""
    from ray_cluster import scrape

    pattern = (
        r'^fleetserve:replica_prefix_cache_queries_total{model_name="tiny",replica="(\d+)"} (\S+)$'
    )
    last: dict[str, float] = {}
    for _ in range(30):
        now = {m[1]: float(m[2]) for m in re.finditer(pattern, scrape(base_url), re.M)}
        if now == last and (sum(now.values()) > 0 or not sent):
            return now
        last = now
        time.sleep(1.5)
    return last


@pytest.mark.slow
def test_adapter_requests_stay_on_one_replica_on_ray(
    cluster: tuple[Any, str], tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import openai

    from fleetserve.ray import build_app
    from lora_helpers import make_adapter
    from ray_cluster import wait_healthy

    root = Path(tmp_path_factory.mktemp("ray-lora"))
    adapters = {name: make_adapter(tiny_llama, root / name, seed) for seed, name in
                enumerate(("first", "second"), start=1)}  # fmt: skip
    third = make_adapter(tiny_llama, root / "third", 3)
    _, base_url = cluster
    serve.run(build_app(_fleet(tiny_llama, adapters)), name="fleetserve", route_prefix="/")
    try:
        wait_healthy(base_url)
        c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)

        # The counts after one send are the counts before the next (nothing is sent in
        # between): each settled read is taken once.
        settled = [_queries(base_url, sent=False)]

        def send(model: str, n: int) -> tuple[dict[str, float], list[str]]:
            """n requests one after another; the replicas whose query counts grew."""
            before = settled[-1]
            for i in range(n):
                c.completions.create(model=model, prompt=f"{model} question {i}:", max_tokens=2)
            after = _queries(base_url)
            settled.append(after)
            return after, [r for r in after if after[r] > before.get(r, 0.0)]

        # Base requests alternate (round robin): both replicas serve.
        after, grew = send("tiny", 2)
        assert len(after) == 2 and len(grew) == 2, after
        # Both engines preloaded "first"; "second" is held by none: the least loaded
        # takes the first request and loads it (evicting "first"), the rest follow it
        # there (round robin alone would alternate).
        _, grew_second = send("second", 6)
        assert len(grew_second) == 1, grew_second
        # "first" is now held only by the other replica: its requests go there.
        _, grew_first = send("first", 4)
        assert len(grew_first) == 1 and grew_first != grew_second, (grew_first, grew_second)
        # Per-adapter series at the ingress: requests and tokens it counted, loads and
        # evictions from the replicas' routing stats (folded in at a scrape, seen at the
        # next one).
        from ray_cluster import scrape

        def series(name: str, adapter: str) -> float:
            pattern = rf'^fleetserve:{name}_total{{lora_name="{adapter}",model_name="tiny"}} (\S+)$'
            m = re.search(pattern, scrape(base_url), re.M)
            return float(m[1]) if m else 0.0

        assert series("lora_requests", "second") == 6
        assert series("lora_requests", "first") == 4
        assert series("lora_generation_tokens", "second") == 12
        for _ in range(20):
            if series("lora_loads", "second") >= 1 and series("lora_evictions", "first") >= 1:
                break
            time.sleep(1.0)
        assert series("lora_loads", "second") >= 1
        assert series("lora_evictions", "first") >= 1
        # vLLM's admin routes through the Ray ingress: an adapter loaded while serving is
        # listed with its parent, served (a replica loads it on first use), and unloaded.
        import httpx

        body = {"lora_name": "third", "lora_path": third}
        r = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 200, r.text
        cards = {m.id: m for m in c.models.list().data}
        assert cards["third"].model_extra["parent"] == "tiny"  # type: ignore[index]
        out = c.completions.create(model="third", prompt="third question", max_tokens=3)
        assert out.model == "third" and out.usage is not None
        bad = {"lora_name": "bad", "lora_path": str(root)}
        r = httpx.post(f"{base_url}/v1/load_lora_adapter", json=bad, timeout=60)
        assert r.status_code == 400 and "not a PEFT adapter folder" in r.text
        r = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "third"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError, match="'third'"):
            c.completions.create(model="third", prompt="third question", max_tokens=3)
    finally:
        serve.delete("fleetserve")
