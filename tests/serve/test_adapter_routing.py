"""Adapter-aware routing: holders first within the load bound, else the least loaded."""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.serve.contracts import RouteRequest
from fleetserve.serve.routing.policies import LeastLoaded, PrefixAffinity
from fleetserve.serve.routing.router import Router


@dataclass
class Load:
    index: int
    num_outstanding_tokens: int = 0
    num_outstanding_requests: int = 0
    healthy: bool = True
    step_latency_s: float | None = None
    lora_names: frozenset[str] = frozenset()


def _req(lora: str | None, prompt: tuple[int, ...] = (1, 2, 3, 4)) -> RouteRequest:
    return RouteRequest("r", prompt, 16, lora_name=lora)


def test_holder_preferred_within_the_bound() -> None:
    replicas = [
        Load(0, num_outstanding_tokens=100),
        Load(1, num_outstanding_tokens=900, lora_names=frozenset({"a"})),
        Load(2, num_outstanding_tokens=3000, lora_names=frozenset({"b"})),
    ]
    router = Router(replicas, LeastLoaded(), overload_requests=8, adapter_imbalance_tokens=2048)
    assert router.choose(_req("a")).index == 1  # holds it, 800 tokens behind: within 2048
    assert router.choose(_req("b")).index == 0  # holder 2900 behind: the least loaded loads it
    assert router.choose(_req("c")).index == 0  # nobody holds it
    assert router.choose(_req(None)).index == 0  # the base model is not narrowed
    replicas[0].lora_names = frozenset({"a"})
    assert router.choose(_req("a")).index == 0  # two holders: the policy picks among them


def test_prefix_affinity_keeps_adapters_apart() -> None:
    policy = PrefixAffinity(block_size=4)
    prompt = tuple(range(8))
    assert policy.block_hashes(prompt, "a") != policy.block_hashes(prompt, None)
    assert policy.block_hashes(prompt, "a") != policy.block_hashes(prompt, "b")
    assert policy.block_hashes(prompt, "a") == policy.block_hashes(prompt, "a")
    replicas = [Load(0), Load(1, num_outstanding_tokens=10)]
    assert policy.choose(_req(None, prompt), replicas).index == 0
    replicas[0].num_outstanding_tokens = 50
    # Same prompt under an adapter: no remembered chain, so the least loaded.
    assert policy.choose(_req("a", prompt), replicas).index == 1
    assert policy.choose(_req(None, prompt), replicas).index == 0  # base chain: its owner
