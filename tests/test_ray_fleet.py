"""The fleet as a Ray Serve application on a simulated three-node cluster: every endpoint
through Serve's HTTP proxy with the official openai client (outputs checked against the
local engine and the local embedding model), replicas spread over the worker nodes,
streams that survive the loss of their replica (its engine process or its actor killed
-9: request migration, each stream identical to an undisturbed run), and a worker node
removed under load without any request failing or hanging. Only processes this test
started are signalled, by pid."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from helpers import stream_completion
from ray_cluster import (
    engine_core_pid,
    pid_alive,
    ray_cluster,
    replica_actors,
    replica_nodes,
    replica_pids,
    wait_healthy,
    wait_until,
)

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

API_KEY = "ray-test-key"
PROMPT = "The quick brown fox"
STEP_DELAY_S = "0.05"


def fleet_config(model: str) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "tiny",
                "model": model,
                "replicas": 2,
                # Round robin: 8 streams sent at once split 4 + 4. (least_loaded sees
                # equal loads when Serve routes them together and may put all on one.)
                "routing": "round_robin",
                "engine": {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 256},
                "placement": {"num_cpus": 1, "max_replicas_per_node": 1},
            },
            {
                "name": "minilm",
                "kind": "embed",
                "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.01},
                "placement": {"num_cpus": 0.5},
            },
            {
                "name": "classifier",
                "kind": "custom",
                "handler": "fleet_handlers:Classifier",
                "options": {"labels": ["even", "odd"]},
                "placement": {"num_cpus": 0.25},
            },
        ],
        "classes": {
            "interactive": {"priority": 0, "max_waiting": 16},
            "batch": {"priority": 10, "max_waiting": 64},
        },
        "default_class": "interactive",
    }


@pytest.fixture(scope="module")
def fleet(tiny_llama: str) -> Iterator[tuple[Any, str]]:
    from fleetserve.ray import IngressOptions, build_app

    # Paced engine steps, so that requests are still streaming when a node is removed.
    with ray_cluster(env={"FLEETSERVE_DEBUG_STEP_DELAY_S": STEP_DELAY_S}) as (cluster, base_url):
        app = build_app(fleet_config(tiny_llama), IngressOptions(api_key=API_KEY))
        serve.run(app, name="fleetserve", route_prefix="/")
        wait_healthy(base_url)
        yield cluster, base_url


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def local_greedy(model: str, prompt: str, max_tokens: int) -> str:
    from fleetserve import LLM, SamplingParams

    llm = LLM(model, max_model_len=256, num_threads=1)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return out.outputs[0].text


def test_every_endpoint_through_serve(fleet: tuple[Any, str], tiny_llama: str) -> None:
    _, base_url = fleet
    c = client(base_url)
    models = {m.id for m in c.models.list().data}
    assert models == {"tiny", "minilm", "classifier"}

    want = local_greedy(tiny_llama, PROMPT, 12)
    got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    assert got.usage is not None and got.usage.completion_tokens == 12

    pieces = [
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(pieces) == want

    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        if ch.choices
    )
    assert chat.choices[0].message.content == streamed
    assert chat.usage is not None and chat.usage.completion_tokens == 8

    from fleetserve.engine.embedding import MINILM_NAME, EmbeddingModel

    texts = ["a cat sat on the mat", "fleets of replicas"]
    emb = c.embeddings.create(model="minilm", input=texts)
    ref = EmbeddingModel.load(MINILM_NAME).embed(texts).vectors
    np.testing.assert_allclose(np.array([d.embedding for d in emb.data]), ref, atol=1e-5)

    r = httpx.post(
        f"{base_url}/v1/models/classifier:predict",
        json={"instances": [{"text": "abcd"}, {"text": "abc"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "predictions": [{"label": "even", "length": 4}, {"label": "odd", "length": 3}]
    }


def test_only_the_model_processes_load_torch(fleet: tuple[Any, str]) -> None:
    """The ingress, a generate replica's actor (its engine runs in a child process) and a
    custom model's replica serve without torch, as the local server's API process does;
    the embedding replica and each engine process load it (after the requests above)."""

    def maps_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    wants = {"ingress": False, "model-tiny": False, "model-classifier": False}
    for deployment, want in {**wants, "model-minilm": True}.items():
        pids = list(replica_pids(deployment).values())
        assert pids, deployment
        assert [maps_torch(pid) for pid in pids] == [want] * len(pids), deployment
    for pid in replica_pids("model-tiny").values():
        assert maps_torch(engine_core_pid(pid))


def test_errors_and_auth_match_the_local_server(fleet: tuple[Any, str]) -> None:
    _, base_url = fleet
    r = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401
    c = client(base_url)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embed model"):
        c.completions.create(model="minilm", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    assert err.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="service_tier"):
        c.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"service_tier": "gold"}
        )
    r = httpx.post(
        f"{base_url}/v1/models/classifier:predict",
        json={"instances": [{"text": "boom"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 400 and "instances[0]" in r.json()["error"]["message"], r.text
    metrics = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert 'fleetserve:num_requests_waiting{class="interactive",model_name="tiny"}' in metrics.text


def test_replicas_spread_over_the_worker_nodes(fleet: tuple[Any, str]) -> None:
    cluster, _ = fleet
    nodes = replica_nodes("model-tiny")
    assert len(nodes) == 2
    assert len(set(nodes)) == 2
    head = cluster.head_node.node_id
    assert head not in nodes  # the head has no CPU for them


def test_interactive_overtakes_a_batch_flood(fleet: tuple[Any, str]) -> None:
    """The ingress's class queue sends the interactive request ahead of the batch requests
    queued before it, and the engine's priority scheduler runs it ahead of those running."""
    _, base_url = fleet
    c = client(base_url)
    finished: list[str] = []

    def one(name: str, cls: str, max_tokens: int) -> None:
        c.completions.create(
            model="tiny",
            prompt=f"{PROMPT} {name}",
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Fleetserve-Class": cls},
        )
        finished.append(name)

    with concurrent.futures.ThreadPoolExecutor(41) as pool:
        flood = [pool.submit(one, f"batch{i}", "batch", 40) for i in range(40)]
        time.sleep(2.0)  # the flood fills both replicas and the ingress's queue
        urgent = pool.submit(one, "interactive", "interactive", 4)
        urgent.result(timeout=120)
        num_batch_done = len(finished) - 1
        for f in flood:
            f.result(timeout=300)
    # Only the batch requests already running could finish first (2 replicas x 4 seats).
    assert num_batch_done <= 8, finished


def running(model: str) -> int:
    status = serve.status().applications["fleetserve"].deployments[f"model-{model}"]
    return int(status.replica_states.get("RUNNING", 0))


def routed_replicas(base_url: str) -> int:
    """Replicas of 'tiny' the ingress's router knows (from its /metrics)."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    prefix = 'fleetserve:replica_outstanding_requests{model_name="tiny"'
    return sum(1 for line in text.splitlines() if line.startswith(prefix))


MIGRATION_TOKENS = 64


def migration_bodies(n: int) -> list[dict[str, Any]]:
    """Half greedy, half seeded sampling; different prompts, so the streams differ."""
    return [
        {
            "prompt": f"{PROMPT} {i}: the fleet keeps serving",
            "max_tokens": MIGRATION_TOKENS,
            **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}),
        }
        for i in range(n)
    ]


async def stream_one(c: openai.AsyncOpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: its text (the chunks joined), usage and finish reason."""
    text, finish, usage, _ = await stream_completion(
        c, model="tiny", extra_body={"ignore_eos": True}, **body
    )
    return {"text": text, "finish": finish, "usage": usage}


def run_streams(base_url: str, bodies: list[dict[str, Any]], during: Any = None) -> list[Any]:
    """Streams every body at once; `during()` runs in a thread meanwhile (the chaos).
    Each stream's result, or the exception it raised."""

    async def main() -> list[Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as c:
            tasks = [asyncio.ensure_future(stream_one(c, b)) for b in bodies]
            if during is not None:
                await asyncio.to_thread(during)
            return await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=240
            )

    return asyncio.run(main())


def migrations(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    prefix = 'fleetserve:request_migrations_total{model_name="tiny"'
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def outstanding_per_replica(base_url: str) -> list[float]:
    """Requests the ingress's router has on each replica of 'tiny' (from its /metrics)."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    prefix = 'fleetserve:replica_outstanding_requests{model_name="tiny"'
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("victim", ["engine_core", "actor"])
def test_streams_survive_losing_their_replica(fleet: tuple[Any, str], victim: str) -> None:
    """kill -9 of a busy replica's engine process (the actor lives on and fails its health
    check) or of the replica actor's own process: every stream moves to the other replica
    and ends exactly as undisturbed (text, usage, finish), none fails; Serve replaces the
    replica and both serve again."""
    _, base_url = fleet
    bodies = migration_bodies(8)
    reference = run_streams(base_url, bodies)
    for r in reference:
        assert isinstance(r, dict) and r["usage"][1] == MIGRATION_TOKENS, r
    # (The router learns of a replica when it first routes to it: the reference did.)
    wait_until(lambda: routed_replicas(base_url) == 2, 60, "the router to know both replicas")
    before = replica_actors("model-tiny")
    migrated0 = migrations(base_url)
    killed: dict[str, int] = {}

    def kill_a_busy_replica() -> None:
        # Both replicas hold streams (round robin over 2 x 4 seats); the processes are
        # found through Ray's actor table and /proc. (Not through a Serve handle held by
        # this test process: after the earlier modules' clusters in the same process, its
        # `info` calls timed out in CI, cause not found; the test alone passed.)
        wait_until(
            lambda: all(n >= 1 for n in outstanding_per_replica(base_url)),
            60,
            "both replicas holding streams",
            every_s=0.1,
        )
        actor_pid = replica_pids("model-tiny")[min(before)]
        killed["pid"], killed["core_pid"] = actor_pid, engine_core_pid(actor_pid)
        os.kill(killed["core_pid"] if victim == "engine_core" else actor_pid, signal.SIGKILL)

    results = run_streams(base_url, bodies, during=kill_a_busy_replica)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed
    for got, want in zip(results, reference, strict=True):
        assert got == want  # same text, billed once (prompt once, every token once)
    # Streams did move, each once: none went back to the lost replica (the router's
    # `avoid`), which would have cost it another move.
    assert 1 <= migrations(base_url) - migrated0 <= len(bodies)
    # The actor's engine process goes with it (it watches its parent).
    wait_until(lambda: not pid_alive(killed["core_pid"]), 30, "the engine to exit")
    # Serve starts a replacement (health check failed, or the actor died).
    wait_until(
        lambda: replica_actors("model-tiny").keys() - before.keys() and running("tiny") == 2,
        240,
        "Serve to replace the lost replica",
    )
    c = client(base_url)
    for _ in range(4):  # both replicas serve again
        got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert got.usage is not None and got.usage.completion_tokens == 4


def test_removing_a_worker_under_load_fails_no_request(fleet: tuple[Any, str]) -> None:
    cluster, base_url = fleet
    c = client(base_url)

    def one(i: int) -> tuple[str, float]:
        try:
            text = "".join(
                ch.choices[0].text
                for ch in c.completions.create(
                    model="tiny",
                    prompt=f"{PROMPT} {i}",
                    max_tokens=200,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                if ch.choices
            )
            return ("ok" if text else "empty"), time.monotonic()
        except openai.APIError as e:
            return f"error: {e}", time.monotonic()

    # A node with an engine replica but not the ingress (whose loss would drop every
    # connection at once, also within seconds, but then no request shows the replica path).
    ingress_nodes = set(replica_nodes("ingress"))
    victim = next(
        n
        for n in cluster.worker_nodes
        if n.node_id in replica_nodes("model-tiny") and n.node_id not in ingress_nodes
    )
    wait_until(lambda: routed_replicas(base_url) == 2, 240, "the router to know both replicas")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(3.0)
        removed_at = time.monotonic()
        cluster.remove_node(victim)
        done, not_done = concurrent.futures.wait(futures, timeout=90)
    assert not not_done, f"{len(not_done)} requests still open 90 s after the node left"
    results = [f.result() for f in done]
    ended = sorted((round(t - removed_at, 1), r[:400]) for r, t in results)
    print(f"after removing a node (seconds after, result): {ended}")
    # The lost replica's streams move to the other replica (request migration): none fails.
    assert all(r == "ok" for r, _ in results), ended
    got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert got.choices[0].text
