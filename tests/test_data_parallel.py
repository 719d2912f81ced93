"""Data parallelism: routing policies and the router on fake replicas (exact choices), the
replica handle's load accounting, and DP=2 servers end to end on the tiny model."""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.core_proc import debug_step_delay_s
from fleetserve.engine.delta_stream import DeltaStream
from fleetserve.engine.stats import EngineStats
from fleetserve.outputs import CompletionOutput, RequestOutput
from fleetserve.serve.contracts import RouteRequest
from fleetserve.serve.replicas.local import LocalReplica
from fleetserve.serve.routing.policies import (
    LeastLoaded,
    PowerOfTwo,
    PrefixAffinity,
    RoundRobin,
    make_policy,
)
from fleetserve.serve.routing.router import NoHealthyReplicaError, Router

sys.path.insert(0, str(Path(__file__).parent / "server"))

from server_proc import ServerProc, metric, scrape, wait_until  # noqa: E402


@dataclass
class Fake:
    index: int
    num_outstanding_tokens: int = 0
    num_outstanding_requests: int = 0
    step_latency_s: float | None = None
    healthy: bool = True


def fakes(*tokens: int) -> list[Fake]:
    return [Fake(i, t) for i, t in enumerate(tokens)]


def req(ids: list[int] | tuple[int, ...] = (1, 2, 3), new: int = 4) -> RouteRequest:
    return RouteRequest("r", tuple(ids), new)


def picks(router: Router[Fake], n: int) -> list[int]:
    return [router.choose(req()).index for _ in range(n)]


# ------------------------------------------------------------------ policies
def test_round_robin_order_and_skips_unhealthy() -> None:
    reps = fakes(0, 0, 0)
    router = Router(reps, RoundRobin(), overload_requests=8)
    assert picks(router, 7) == [0, 1, 2, 0, 1, 2, 0]
    reps[1].healthy = False
    assert picks(router, 4) == [2, 0, 2, 0]
    reps[1].healthy = True
    assert picks(router, 3) == [1, 2, 0]


def test_least_loaded_picks_fewest_tokens_then_requests_then_index() -> None:
    policy = LeastLoaded()
    reps = fakes(50, 10, 30)
    assert policy.choose(req(), reps).index == 1
    reps = [Fake(0, 10, 3), Fake(1, 10, 2), Fake(2, 40, 0)]
    assert policy.choose(req(), reps).index == 1
    assert policy.choose(req(), fakes(7, 7, 7)).index == 0


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica() -> None:
    policy = PrefixAffinity(block_size=4, imbalance_tokens=100)
    reps = fakes(0, 0, 0)
    a = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
    b = [21, 22, 23, 24, 25, 26, 27, 28]
    assert policy.choose(req(a + [1]), reps).index == 0  # no match: least loaded
    reps[0].num_outstanding_tokens = 60
    assert policy.choose(req(b + [2]), reps).index == 1  # no match: least loaded
    reps[1].num_outstanding_tokens = 80
    # Same prefix, other suffixes: back to the replica holding it, though busier.
    for suffix in ([3], [4, 5], [6, 7, 8, 9, 10]):
        assert policy.choose(req(a + suffix), reps).index == 0
        assert policy.choose(req(b + suffix), reps).index == 1
    # Only the first block shared: still the owner of that one-block chain.
    assert policy.choose(req(a[:4] + [99, 98, 97, 96]), reps).index == 0
    # A prompt shorter than one block has no full block to match: least loaded.
    assert policy.choose(req([11, 12, 13]), reps).index == 2
    assert policy.owner_of(a) == 0 and policy.owner_of(b) == 1


def test_prefix_affinity_falls_back_past_the_imbalance_threshold() -> None:
    policy = PrefixAffinity(block_size=4, imbalance_tokens=100)
    reps = fakes(0, 0)
    a = [5, 6, 7, 8, 9]
    assert policy.choose(req(a), reps).index == 0
    reps[0].num_outstanding_tokens = 100  # exactly at the threshold: stays
    assert policy.choose(req(a), reps).index == 0
    reps[0].num_outstanding_tokens = 101  # past it: the least-loaded one takes over...
    assert policy.choose(req(a), reps).index == 1
    assert policy.owner_of(a) == 1  # ...and now holds the prefix
    reps[0].num_outstanding_tokens = 0
    assert policy.choose(req(a), reps).index == 1
    # The owner is not a candidate (dead or a straggler): least loaded among the rest.
    assert policy.choose(req(a), [reps[0]]).index == 0


def test_prefix_affinity_lru_bound_and_hash_chain() -> None:
    policy = PrefixAffinity(block_size=2, max_entries=3)
    reps = fakes(0, 0)
    policy.choose(req([1, 2, 3, 4]), reps)  # 2 entries, owner 0
    reps[0].num_outstanding_tokens = 5
    policy.choose(req([7, 8]), reps)  # 1 entry, owner 1
    assert len(policy) == 3
    policy.choose(req([9, 9]), reps)  # evicts the oldest entry: the chain's first block
    assert len(policy) == 3
    assert policy.owner_of([1, 2]) is None
    # A chain hash covers the whole prefix: [1, 2, 3, 4] is still known, [0, 0, 3, 4] not.
    assert policy.owner_of([1, 2, 3, 4]) == 0
    assert policy.owner_of([0, 0, 3, 4]) is None
    assert policy.block_hashes([1, 2, 3]) == policy.block_hashes([1, 2])


def test_power_of_two_is_seeded_and_picks_the_less_loaded_of_two() -> None:
    reps = fakes(0, 100, 200, 300)
    first = [PowerOfTwo(seed=7).choose(req(), reps).index for _ in range(1)]
    p1, p2, p3 = PowerOfTwo(seed=7), PowerOfTwo(seed=7), PowerOfTwo(seed=8)
    seq1 = [p1.choose(req(), reps).index for _ in range(40)]
    seq2 = [p2.choose(req(), reps).index for _ in range(40)]
    seq3 = [p3.choose(req(), reps).index for _ in range(40)]
    assert seq1 == seq2 and seq1[:1] == first
    assert seq1 != seq3
    # Sample the pairs the same way: the pick is always the pair's less loaded one.
    rng = random.Random(7)
    expected = [min(rng.sample(range(4), 2)) for _ in range(40)]
    assert seq1 == expected
    assert 3 not in seq1  # the most loaded replica loses every pair it is in
    assert PowerOfTwo(seed=1).choose(req(), [reps[2]]).index == 2


def test_make_policy_names() -> None:
    assert make_policy("round_robin").name == "round_robin"
    assert make_policy("power_of_two", seed=3).name == "power_of_two"
    assert isinstance(make_policy("prefix_affinity", block_size=8), PrefixAffinity)
    with pytest.raises(ValueError, match="routing must be one of"):
        make_policy("random")


# ------------------------------------------------------------------ router
def test_router_routes_around_a_straggler_unless_the_others_are_full() -> None:
    reps = fakes(0, 0, 0)
    for r, lat in zip(reps, (0.010, 0.012, 0.030), strict=True):
        r.step_latency_s = lat
    now = [0.0]
    router = Router(reps, RoundRobin(), overload_requests=4, probe_interval_s=5.0,
                    clock=lambda: now[0])  # fmt: skip
    assert [r.index for r in router.stragglers()] == [2]  # 0.030 > 2 * median(0.010, 0.012)
    assert picks(router, 4) == [0, 1, 0, 1]
    reps[0].num_outstanding_requests = 4
    assert picks(router, 2) == [0, 1]  # a fast one still has room: 2 stays out (rr ignores load)
    reps[1].num_outstanding_requests = 4
    assert picks(router, 3) == [2, 0, 1]  # every fast one is full: all are candidates
    reps[0].num_outstanding_requests = reps[1].num_outstanding_requests = 0
    # Just under the factor is not a straggler; an unmeasured replica never is.
    reps[2].step_latency_s = 0.021
    assert router.stragglers() == []
    # Twice as slow but within the minimum gap (10 ms): scheduling noise, not a straggler.
    reps[0].step_latency_s, reps[1].step_latency_s, reps[2].step_latency_s = 0.001, 0.001, 0.009
    assert router.stragglers() == []
    reps[2].step_latency_s = None
    assert router.stragglers() == []


def test_router_probes_an_idle_straggler_after_the_interval() -> None:
    reps = fakes(0, 0)
    reps[0].step_latency_s, reps[1].step_latency_s = 0.01, 0.05
    now = [100.0]
    router = Router(reps, LeastLoaded(), overload_requests=4, probe_interval_s=5.0,
                    clock=lambda: now[0])  # fmt: skip
    reps[0].num_outstanding_tokens = 1000
    assert picks(router, 2) == [0, 0]  # ejected at t=100, though less loaded
    now[0] = 105.0
    assert picks(router, 1) == [1]  # idle for the interval: one probe
    assert picks(router, 1) == [0]
    now[0] = 111.0
    reps[1].num_outstanding_requests = 1  # busy: no probe
    assert picks(router, 1) == [0]
    reps[1].step_latency_s = 0.012  # recovered
    reps[1].num_outstanding_requests = 0
    assert picks(router, 1) == [1]


def test_router_dead_replicas_and_exclusions() -> None:
    reps = fakes(0, 0)
    router = Router(reps, LeastLoaded(), overload_requests=4)
    assert router.choose(req(), exclude={0}).index == 1
    reps[0].healthy = False
    assert picks(router, 2) == [1, 1]
    with pytest.raises(NoHealthyReplicaError):
        router.choose(req(), exclude={1})
    # A dead replica's stale step latency neither makes it nor the others stragglers.
    reps[0].step_latency_s, reps[1].step_latency_s = 0.001, 0.05
    assert router.stragglers() == []
    with pytest.raises(ValueError, match="straggler_factor"):
        Router(reps, LeastLoaded(), overload_requests=4, straggler_factor=1.0)


# ------------------------------------------------------------------ replica handle
class FakeStream(DeltaStream):
    """An engine client's stream whose next delta arrives as the reader asks for it."""

    def __init__(self, outs: list[RequestOutput]) -> None:
        super().__init__("x", 2, lambda s: None)
        self.outs = outs

    async def __anext__(self) -> RequestOutput:
        if self.outs:
            self.deltas.put(self.outs.pop(0))
        return await super().__anext__()


def output(lengths: list[int], finished: bool) -> RequestOutput:
    """A delta: `lengths` new tokens per choice."""
    choices = [CompletionOutput(i, "", list(range(n)), None, None) for i, n in enumerate(lengths)]
    return RequestOutput("x", None, [1, 2, 3], choices, finished)


def make_handle(outs: list[RequestOutput]) -> tuple[LocalReplica, FakeStream]:
    stream = FakeStream(outs)

    def add_request(
        rid: str, prompt: Any, params: SamplingParams, priority: int, resume: Any = None
    ) -> FakeStream:
        if params.max_tokens is None:
            params.max_tokens = 50  # as AsyncEngine fills it in
        return stream

    engine = SimpleNamespace(is_ready=True, on_stats=None, add_request=add_request)
    return LocalReplica(0, engine, ewma_alpha=0.5, warmup_steps=2), stream  # type: ignore[arg-type]


def test_replica_handle_load_accounting() -> None:
    outs = [output([0, 0], False), output([3, 1], False), output([0, 1], False),
            output([7, 8], True)]  # fmt: skip
    handle, inner = make_handle(outs)
    params = SamplingParams(n=2, max_tokens=10)
    stream = handle.submit("x", [1, 2, 3], params, 0, num_prompt_tokens=3)
    assert (handle.num_outstanding_requests, handle.num_outstanding_tokens) == (1, 3 + 20)
    seen = []

    async def consume() -> None:
        async for _ in stream:
            seen.append(handle.num_outstanding_tokens)

    asyncio.run(consume())
    # Prefilled (-3), then 4 tokens, then 1 more, then the last 15.
    assert seen == [20, 16, 15, 0]
    assert (handle.num_outstanding_requests, handle.num_routed) == (1 - 1, 1)
    stream.close()  # closing after the end settles nothing twice
    assert inner.closed and handle.num_outstanding_tokens == 0


def test_replica_handle_close_early_and_default_max_tokens() -> None:
    handle, _ = make_handle([output([2], False), output([3], False)])
    stream = handle.submit("x", [1] * 7, SamplingParams(max_tokens=None), 0, num_prompt_tokens=7)
    assert handle.num_outstanding_tokens == 7 + 50

    async def first() -> None:
        await stream.__anext__()

    asyncio.run(first())
    assert handle.num_outstanding_tokens == 48
    stream.close()  # the client left: everything it still held is released
    assert (handle.num_outstanding_requests, handle.num_outstanding_tokens) == (0, 0)


def test_replica_handle_step_latency_ewma() -> None:
    handle, _ = make_handle([])
    calls: list[int] = []
    handle.on_stats = lambda h: calls.append(h.index)
    handle._update_stats(EngineStats(num_steps=1, last_step_seconds=0.4))
    assert handle.step_latency_s is None  # still warming up
    handle._update_stats(EngineStats(num_steps=1, last_step_seconds=9.0))  # no new step: ignored
    handle._update_stats(EngineStats(num_steps=2, last_step_seconds=0.2, num_requests_waiting=3))
    assert handle.step_latency_s == pytest.approx(0.3)
    assert handle.queue_depth == 3 and calls == [0, 0, 0]


def test_debug_step_delay_format() -> None:
    assert debug_step_delay_s(None, 0) == 0.0
    assert debug_step_delay_s("0.5", 3) == 0.5
    assert debug_step_delay_s("1:0.2,3:0.4", 1) == 0.2
    assert debug_step_delay_s("1:0.2,3:0.4", 3) == 0.4
    assert debug_step_delay_s("1:0.2", 0) == 0.0
    with pytest.raises(ValueError, match="FLEETSERVE_DEBUG_STEP_DELAY_S"):
        debug_step_delay_s("one:0.2", 1)


# ------------------------------------------------------------------ end to end, DP=2
# Three DP=2 servers (each one API process and two engine processes) keep the module
# within its CPU budget. prefix_affinity routes a prompt with no full block (all the short
# prompts below) by the least-loaded rule, so that server also runs the balance tests.
# The servers whose tests are not about stragglers give both replicas the same step-time
# floor (EVEN_STEP_S): the straggler rule needs one replica's step EWMA above 2x the other's
# and 10 ms more, which another test worker's CPU load can cause on bare tiny-model steps
# but not on top of an equal floor. The slowed replica's delay is likewise far above noise.
EVEN_STEP_S = 0.03
SLOW_STEP_S = 0.2
_EVEN = {"FLEETSERVE_DEBUG_STEP_DELAY_S": str(EVEN_STEP_S)}
_SERVER_ARGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "round_robin": (["--routing", "round_robin", "--scheduling-policy", "priority"], _EVEN),
    "prefix_affinity": (["--routing", "prefix_affinity"], _EVEN),
    # Replica 1 is slowed; after the straggler test, its death is tested too.
    "slow": (["--routing", "round_robin"], {"FLEETSERVE_DEBUG_STEP_DELAY_S": f"1:{SLOW_STEP_S}"}),
}


@dataclass
class Fleet:
    procs: dict[str, ServerProc] = field(default_factory=dict)

    def __getitem__(self, name: str) -> ServerProc:
        return self.procs[name].wait_ready()


@pytest.fixture(scope="module")
def fleet(tiny_llama: str) -> Iterator[Fleet]:
    """All DP=2 servers of this module, started at once so that they load in parallel."""
    f = Fleet()
    try:
        for name, (args, env) in _SERVER_ARGS.items():
            f.procs[name] = ServerProc(
                tiny_llama, "--served-model-name", "tiny", "--data-parallel-size", "2",
                "--num-threads", "2", *args, env=env,
            )  # fmt: skip
        yield f
    finally:
        for p in f.procs.values():  # drain all at once, then wait for each
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in f.procs.values():
            p.stop()


def replica_values(url: str, name: str) -> list[float]:
    values = scrape(url)
    return [metric(values, f"fleetserve:replica_{name}", replica=str(i)) for i in range(2)]


def run_async(coro_fn: Callable[[openai.AsyncOpenAI], Any], url: str) -> Any:
    async def main() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.wait_for(coro_fn(c), timeout=90)

    return asyncio.run(main())


async def complete(c: openai.AsyncOpenAI, prompt: Any, max_tokens: int) -> str:
    out = await c.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return out.choices[0].text


def shared_prefix_hit_rate(url: str) -> float:
    """3 distinct 64-token prefixes x 6 requests, in rounds of one request per prefix; the
    replicas' pooled prefix-cache hit rate over them."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(3)]
    before = (replica_values(url, "prefix_cache_hits_total"),
              replica_values(url, "prefix_cache_queries_total"))  # fmt: skip

    async def work(c: openai.AsyncOpenAI) -> None:
        for k in range(6):
            await asyncio.gather(*(complete(c, p + [500 + k, 501 + k], 2) for p in prefixes))

    run_async(work, url)
    hits = sum(replica_values(url, "prefix_cache_hits_total")) - sum(before[0])
    queries = sum(replica_values(url, "prefix_cache_queries_total")) - sum(before[1])
    assert queries == 18 * 66
    return hits / queries


def test_prefix_affinity_beats_round_robin_on_shared_prefixes(fleet: Fleet) -> None:
    rr = shared_prefix_hit_rate(fleet["round_robin"].url)
    pa = shared_prefix_hit_rate(fleet["prefix_affinity"].url)
    # Each prefix computed once (pa: 15 of 18 requests hit 64 tokens) vs about once per
    # replica (rr: about 12 of 18).
    assert pa == pytest.approx(15 * 64 / (18 * 66))
    assert rr < pa - 0.1
    # The model-level gauge pools the replicas' counts.
    url = fleet["prefix_affinity"].url
    pooled = sum(replica_values(url, "prefix_cache_hits_total")) / sum(
        replica_values(url, "prefix_cache_queries_total")
    )
    assert metric(scrape(url), "fleetserve:prefix_cache_hit_rate") == pytest.approx(pooled)


def test_greedy_dp2_equals_dp1(fleet: Fleet, tiny_llama: str) -> None:
    from fleetserve.engine.llm import LLM

    prompts = ["The old sailor found a red box", "Our teacher", "every student", "the king"]
    llm = LLM(tiny_llama)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        offline = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    url = fleet["round_robin"].url
    routed = replica_values(url, "requests_routed_total")

    async def work(c: openai.AsyncOpenAI) -> list[str]:
        return await asyncio.gather(*(complete(c, p, 12) for p in prompts * 2))

    assert run_async(work, url) == offline * 2
    after = replica_values(url, "requests_routed_total")
    assert [a - b for a, b in zip(after, routed, strict=True)] == [4, 4]  # both replicas served
    # A request with a priority goes through the router to a replica like any other.
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 12,
                      "temperature": 0, "ignore_eos": True, "priority": 5}, timeout=60)  # fmt: skip
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == offline[0]


def test_least_loaded_sends_short_requests_away_from_a_busy_replica(fleet: Fleet) -> None:
    url = fleet["prefix_affinity"].url  # prompts shorter than a block: the least-loaded rule
    assert wait_until(lambda: replica_values(url, "outstanding_tokens") == [0, 0], 10)
    routed = replica_values(url, "requests_routed_total")

    async def work(c: openai.AsyncOpenAI) -> list[float]:
        long = await c.completions.create(
            model="tiny", prompt="the farmer", max_tokens=1500, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        await long.__anext__()  # it is running on a replica now
        outstanding = replica_values(url, "outstanding_tokens")
        await asyncio.gather(*(complete(c, f"my friend {i}", 4) for i in range(8)))
        await long.close()  # aborts it
        return outstanding

    outstanding = run_async(work, url)
    # Both idle: the long one went to replica 0 (ties go to the lower index).
    assert outstanding[0] > 1000 and outstanding[1] == 0
    after = replica_values(url, "requests_routed_total")
    assert [a - b for a, b in zip(after, routed, strict=True)] == [1, 8]  # round robin: 5 / 4
    assert wait_until(lambda: replica_values(url, "outstanding_tokens") == [0, 0], 10)


def test_slowed_replica_gets_less_traffic(fleet: Fleet) -> None:
    url = fleet["slow"].url

    async def work(c: openai.AsyncOpenAI) -> None:
        for i in range(10):
            await complete(c, f"the robot {i}", 10)

    run_async(work, url)
    routed = replica_values(url, "requests_routed_total")
    # Round robin sends the first two one each; replica 1's ~10 slow steps make it a
    # straggler, and the rest go to replica 0.
    assert routed == [9, 1]
    latency = replica_values(url, "step_latency_seconds")
    assert latency[1] > SLOW_STEP_S and latency[1] > 2 * latency[0]
    assert replica_values(url, "straggler") == [0, 1]


def core_pid(server: ServerProc, rank: int) -> int:
    tag = f'"data_parallel_rank":{rank}'
    import psutil

    for p in server.descendants():
        try:
            cmdline = p.cmdline()
        except psutil.Error:  # a core just killed (a zombie until reaped)
            continue
        if any(tag in arg for arg in cmdline):
            return p.pid
    raise AssertionError(f"no engine core with {tag}")


def healthy_replicas(url: str) -> dict[int, float]:
    """replica index -> its healthy gauge, for every replica the server has now."""
    out = {}
    for key, v in scrape(url).items():
        if key.startswith("fleetserve:replica_healthy{"):
            out[int(key.split('replica="')[1].split('"')[0])] = v
    return out


def test_dead_replica_is_replaced_and_ready_stays_up(fleet: Fleet) -> None:
    import os

    server = fleet["slow"]  # last use of this server: its replicas die here
    url = server.url
    os.kill(core_pid(server, 1), signal.SIGKILL)
    # Noticed and removed, and a replacement (index 2) is started.
    assert wait_until(lambda: 1 not in healthy_replicas(url), 10)
    assert httpx.get(f"{url}/ready").status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200

    async def work(c: openai.AsyncOpenAI) -> list[str]:
        return await asyncio.gather(*(complete(c, f"the cat {i}", 3) for i in range(4)))

    assert len(run_async(work, url)) == 4
    assert wait_until(lambda: healthy_replicas(url) == {0: 1, 2: 1}, 120)
    # Every replica dies: the model is down (/ready 503) until a replacement is up, and a
    # request sent meanwhile waits for it instead of failing.
    for rank in (0, 2):
        os.kill(core_pid(server, rank), signal.SIGKILL)
    assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 503, 10)
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2
    assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, 60)
