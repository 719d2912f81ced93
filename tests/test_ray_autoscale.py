"""Autoscaling on queue depth through Ray Serve (fleetserve/ray/autoscale.py): load raises
a model's replica count and idleness lowers it again (min 1 -> 2 -> 1), and a model scaled
to zero serves its first request once a replica is up instead of failing (0 -> 1 -> 0).
The reaction times are printed (docs/benchmarks.md quotes them), never asserted."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ray_cluster import ray_cluster, wait_healthy, wait_until

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

STEP_DELAY_S = "0.05"
DOWNSCALE_DELAY_S = 2.0  # idle this long before a replica goes (was 5: only waited)


def fleet(model: str) -> dict[str, Any]:
    engine = {"max_num_seqs": 2, "num_threads": 1, "max_model_len": 256}
    delays = {
        "upscale_delay_s": 1.0,
        "downscale_delay_s": DOWNSCALE_DELAY_S,
        "target_queue_depth": 1,
    }
    return {
        "models": [
            {
                "name": "hot",
                "model": model,
                "engine": engine,
                "autoscale": {"min_replicas": 1, "max_replicas": 2, **delays},
                "placement": {"num_cpus": 1},
            },
            {
                "name": "cold",
                "model": model,
                "engine": engine,
                "autoscale": {"min_replicas": 0, "max_replicas": 1, **delays},
                "placement": {"num_cpus": 1},
            },
        ]
    }


@pytest.fixture(scope="module")
def app(tiny_llama: str) -> Iterator[str]:
    from fleetserve.ray import build_app

    with ray_cluster(env={"FLEETSERVE_DEBUG_STEP_DELAY_S": STEP_DELAY_S}) as (_, base_url):
        serve.run(build_app(fleet(tiny_llama)), name="fleetserve", route_prefix="/")
        wait_healthy(base_url)
        yield base_url


def running(model: str) -> int:
    status = serve.status().applications["fleetserve"].deployments[f"model-{model}"]
    return int(status.replica_states.get("RUNNING", 0))


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300)


def test_load_adds_a_replica_and_idleness_removes_it(app: str) -> None:
    c = client(app)
    assert running("hot") == 1

    def one(i: int) -> int:
        out = c.completions.create(
            model="hot",
            prompt=f"load {i}",
            max_tokens=60,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage is not None
        return out.usage.completion_tokens

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        wait_until(lambda: running("hot") >= 2, 240, "a second replica of 'hot'")
        scaled_up = time.monotonic() - start
        assert [f.result(timeout=300) for f in futures] == [60] * 12
    idle_since = time.monotonic()
    wait_until(lambda: running("hot") == 1, 240, "'hot' back to one replica")
    scaled_down = time.monotonic() - idle_since
    print(f"hot: 1 -> 2 replicas {scaled_up:.1f} s after the load began; back to 1 "
          f"{scaled_down:.1f} s after it ended (downscale_delay_s {DOWNSCALE_DELAY_S})")  # fmt: skip


def test_scaled_to_zero_serves_its_first_request(app: str) -> None:
    c = client(app)
    assert running("cold") == 0
    start = time.monotonic()
    out = c.completions.create(model="cold", prompt="wake up", max_tokens=4, temperature=0)
    cold_start = time.monotonic() - start
    assert out.usage is not None and out.usage.completion_tokens == 4
    assert running("cold") == 1
    idle_since = time.monotonic()
    wait_until(lambda: running("cold") == 0, 240, "'cold' back to zero replicas")
    print(f"cold: first request answered {cold_start:.1f} s after it was sent (0 -> 1); "
          f"back to 0 {time.monotonic() - idle_since:.1f} s after it")  # fmt: skip
