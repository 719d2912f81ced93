"""Spot and on-demand pools of a real model service (engine processes of a tiny model):
spot-first routing, the on-demand fallback when spot is preempted and cannot be
provisioned, its release when spot returns, batch pinned to spot, and a spot notice from
a cloud metadata stand-in draining a replica with nothing lost.

The spot market is the one part that cannot run here: `capacity_check` stands in for it
(the cloud refusing spot capacity), as the metadata stand-ins stand in for the clouds'
metadata endpoints."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from metadata_standins import AwsImdsStandIn, AzureScheduledEventsStandIn, GcpMetadataStandIn

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.metrics import ServerMetrics
from fleetserve.serve.admission.sla import ServiceClass
from fleetserve.serve.config.fleet_config import (
    ModelEntry,
    NoticeConfig,
    PoolConfig,
    ResilienceConfig,
)
from fleetserve.serve.services.generate import GenerateService

CLASSES = {
    "interactive": ServiceClass("interactive", priority=0),
    "batch": ServiceClass("batch", priority=10),
}


def build(model: str, pools: list[PoolConfig], market: dict[str, bool]) -> GenerateService:
    entry = ModelEntry(
        name="m",
        model=model,
        engine={"max_num_seqs": 8, "num_threads": 1},
        resilience=ResilienceConfig(hang_timeout_s=None),
        pools=pools,
    )
    svc = GenerateService(
        entry,
        CLASSES,
        "interactive",
        metrics=ServerMetrics().model("m"),
        spot_only_classes=frozenset({"batch"}),
        capacity_check=lambda pool: market["open"] or not pool.is_spot,
    )
    svc.controller.max_backoff_s = 2.0  # retry spot every 2 s at most: a short test
    return svc


async def generate(svc: GenerateService, rid: str, cls: str, max_tokens: int = 8) -> Any:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    streams = await svc.admit(rid, ["the pool keeps serving"], lambda: params, cls)
    async for _ in streams[0]:
        pass
    whole = streams[0].state.fold.output()  # the deltas its reader got, folded
    assert whole.finished
    return whole.outputs[0]


def ready(svc: GenerateService, pool: str) -> list[dict[str, Any]]:
    return [v for v in svc.replica_views() if v["pool"] == pool and v["state"] == "ready"]


async def wait_for(pred: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


def run(main: Callable[[], Awaitable[None]]) -> None:
    # A hang guard, not a speed claim: under a load of 11 one of these tests took 80 s
    # (engine processes starting on busy cores), and CI machines can be busier.
    asyncio.run(asyncio.wait_for(main(), 480))


def spot_pool(**kw: Any) -> PoolConfig:
    return PoolConfig(name="spot", capacity="spot", replicas=1, **kw)


def test_fallback_to_on_demand_and_back(tiny_llama: str) -> None:
    market = {"open": True}
    pools = [spot_pool(), PoolConfig(name="base", capacity="on_demand", replicas=1, max_fallback=1)]

    async def main() -> None:
        svc = build(tiny_llama, pools, market)
        await svc.start()
        try:
            assert len(ready(svc, "spot")) == 1 and len(ready(svc, "base")) == 1
            [spot] = [r for r in svc.replica_set if r.pool == "spot"]
            [base] = [r for r in svc.replica_set if r.pool == "base"]
            for i in range(3):  # spot first: the base idles while spot has room
                await generate(svc, f"warm{i}", "interactive")
            assert (spot.num_routed, base.num_routed) == (3, 0)

            # Spot is preempted and the market has none: on-demand falls back.
            market["open"] = False
            assert spot.pid is not None
            os.kill(spot.pid, signal.SIGKILL)
            await wait_for(lambda: len(ready(svc, "base")) == 2 and not ready(svc, "spot"), 60)
            assert svc.controller.counters()["spot"].capacity_failures >= 1
            batch = asyncio.ensure_future(generate(svc, "b0", "batch"))
            out = await generate(svc, "during", "interactive")  # served on demand
            assert len(out.token_ids) == 8
            await asyncio.sleep(0.5)
            assert not batch.done()  # pinned to spot: it waits for spot

            # Spot is back: a spot replica starts, the fallback one is given back.
            market["open"] = True
            await wait_for(lambda: len(ready(svc, "spot")) == 1, 60)
            out = await asyncio.wait_for(batch, 30)
            assert len(out.token_ids) == 8
            await wait_for(
                lambda: len([v for v in svc.replica_views() if v["pool"] == "base"]) == 1, 60
            )
            assert [v["index"] for v in ready(svc, "base")] == [base.index]  # the base stays
        finally:
            await svc.shutdown()

    run(main)


def preempt(provider: str, standin: Any, seconds: float) -> None:
    if provider == "aws":
        standin.preempt_in(seconds)
    elif provider == "azure":
        standin.preempt_in(seconds, ["vm0"])
    else:
        standin.preempt()  # GCP: no timestamp; 30 s from when it is seen


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_spot_notice_from_metadata_drains_with_nothing_lost(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch, provider: str
) -> None:
    monkeypatch.setenv("FLEETSERVE_DEBUG_STEP_DELAY_S", "0.02")  # streams outlast the notice
    market = {"open": True}
    standins = {
        "aws": AwsImdsStandIn,
        "gcp": GcpMetadataStandIn,
        "azure": AzureScheduledEventsStandIn,
    }

    async def main() -> None:
        with standins[provider]() as meta:
            notice = NoticeConfig(provider=provider, url=meta.url, poll_interval_s=0.2)
            pools = [
                spot_pool(notice=notice),
                PoolConfig(name="base", capacity="on_demand", replicas=1),
            ]
            svc = build(tiny_llama, pools, market)
            await svc.start()
            try:
                [spot] = [r for r in svc.replica_set if r.pool == "spot"]
                # The reference: the same greedy request, undisturbed.
                t_ref = time.monotonic()
                # 100 steps of >= 20 ms: the stream outlasts the notice being seen
                # (polled every 0.2 s) by over a second.
                want = await generate(svc, "ref", "interactive", max_tokens=100)
                ref_s = time.monotonic() - t_ref
                assert spot.num_routed == 1
                task = asyncio.ensure_future(generate(svc, "long", "interactive", 100))
                await wait_for(lambda: spot.num_outstanding_requests == 1, 10)
                await asyncio.sleep(0.3)
                market["open"] = False  # preempted: the cloud takes its capacity back
                t0 = time.monotonic()
                preempt(provider, meta, 6.0)
                await wait_for(lambda: spot.draining, 3)  # seen within a few polls
                assert not task.done()  # the notice came while the stream ran
                # It may move once (a slow step makes the drain hand it over): a bound
                # relative to the reference's own time, so a loaded machine is no failure.
                got = await asyncio.wait_for(task, max(60.0, 4 * ref_s))
                assert got.token_ids == want.token_ids and got.text == want.text
                assert spot.notice is not None and spot.notice.source == provider
                if provider != "gcp":  # GCP's 30 s would make a slow test
                    await wait_for(lambda: spot.dead_reason is not None, 10)
                    assert time.monotonic() - t0 < 6.0  # gone before the notice's deadline
            finally:
                await svc.shutdown()

    run(main)
