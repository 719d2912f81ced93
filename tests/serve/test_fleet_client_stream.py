"""The fleet client's streaming variants over a real GenerateService (one engine process of
the tiny model): the chunks join to the non-streamed answer, each stream is recorded as one
sub-call, a parent deadline ends a stream with 504 and closing it early aborts its request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from fleetserve.entrypoints.openai.fleet_client import FleetCallError, GatewayFleetClient
from fleetserve.metrics import ServerMetrics
from fleetserve.serve.admission.sla import ServiceClass
from fleetserve.serve.config.fleet_config import ModelEntry, ResilienceConfig
from fleetserve.serve.services.generate import GenerateService
from fleetserve.serve.services.service_registry import Registry


def run_with_service(
    tiny_llama: str, main: Callable[[GatewayFleetClient], Awaitable[None]]
) -> None:
    async def outer() -> None:
        classes = {
            "fast": ServiceClass("fast", priority=0),
            "bulk": ServiceClass("bulk", priority=1),
        }
        entry = ModelEntry(
            name="tiny", model=tiny_llama, engine={"max_num_seqs": 4, "num_threads": 1},
            resilience=ResilienceConfig(hang_timeout_s=None),
        )  # fmt: skip
        svc = GenerateService(entry, classes, "fast", metrics=ServerMetrics().model("tiny"))
        await svc.start()
        try:
            await main(GatewayFleetClient(Registry([svc])))
        finally:
            await svc.shutdown()

    asyncio.run(asyncio.wait_for(outer(), 120))


def test_complete_stream_joins_to_the_whole_answer(tiny_llama: str) -> None:
    async def main(client: GatewayFleetClient) -> None:
        scoped = client.scoped("bulk", time.monotonic() + 60)
        whole = await scoped.complete("tiny", "The sea", max_tokens=8, temperature=0.0)
        chunks = [
            c
            async for c in scoped.complete_stream("tiny", "The sea", max_tokens=8, temperature=0.0)
        ]
        assert chunks and all(c["object"] == "text_completion" for c in chunks)
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
        assert text == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert [(c.method, c.status) for c in scoped.calls] == [
            ("complete", 200),
            ("complete_stream", 200),
        ]

    run_with_service(tiny_llama, main)


def test_a_stream_past_the_parents_deadline_is_a_504(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETSERVE_DEBUG_STEP_DELAY_S", "0:0.1")

    async def main(client: GatewayFleetClient) -> None:
        scoped = client.scoped(None, time.monotonic() + 1.0)
        got = 0
        with pytest.raises(FleetCallError) as e:
            async for _ in scoped.complete_stream("tiny", "The sea", max_tokens=200,
                                                  ignore_eos=True):  # fmt: skip
                got += 1
        assert e.value.status == 504 and got < 200
        assert [c.status for c in scoped.calls] == [504]
        # Its engine request was aborted: the replica has nothing left in flight.
        replica = client.registry.services["tiny"].replica_set.get(0)  # type: ignore[attr-defined]
        for _ in range(50):
            if replica.num_outstanding_requests == 0:
                break
            await asyncio.sleep(0.1)
        assert replica.num_outstanding_requests == 0

    run_with_service(tiny_llama, main)
