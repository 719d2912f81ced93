"""GatewayFleetClient's scope: the parent's class and deadline reach each sub-call, every
sub-call is recorded for the parent's log line, cancelling the parent cancels them. The
services here are stand-ins that record what the client hands them (the served path is
tests/server/test_server_fleet_client.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fleetserve.entrypoints.openai.fleet_client import (
    FleetCallError,
    GatewayFleetClient,
    strictest,
)
from fleetserve.serve.services.service_registry import Registry


class SlowCustom:
    kind = "custom"

    def __init__(self, name: str, delay_s: float) -> None:
        self.name, self.delay_s = name, delay_s
        self.cancelled = asyncio.Event()
        self.classes: list[str | None] = []

    async def predict(
        self, instances: Any, class_name: str | None = None, sub_calls: Any = None
    ) -> list[Any]:
        self.classes.append(class_name)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return [{"echo": i} for i in instances]


class RecordingGenerate:
    kind = "generate"
    name = "gen"

    def __init__(self) -> None:
        self.classes: list[str | None] = []

    async def admit(self, request_id: str, prompts: Any, params_for: Any, class_name: Any,
                    priority: int) -> Any:  # fmt: skip
        self.classes.append(class_name)
        raise ValueError("prompt: refused by the stand-in")


def client(*services: Any) -> GatewayFleetClient:
    return GatewayFleetClient(Registry(list(services)))


def test_a_sub_call_answers_and_is_recorded() -> None:
    fast = SlowCustom("fast", 0.0)
    scoped = client(fast).scoped("batch", time.monotonic() + 5)
    body = asyncio.run(scoped.predict("fast", [{"x": 1}]))
    assert body == {"predictions": [{"echo": {"x": 1}}]}
    assert fast.classes == ["batch"]  # a custom callee's own sub-calls take it on
    (sub,) = scoped.calls
    assert (sub.model, sub.method, sub.status) == ("fast", "predict", 200)
    assert str(sub).startswith("predict(fast) 200 ")


def test_a_sub_call_never_waits_past_the_parents_deadline() -> None:
    slow = SlowCustom("slow", 30.0)
    scoped = client(slow).scoped(None, time.monotonic() + 0.2)

    async def run() -> None:
        with pytest.raises(FleetCallError) as e:
            await scoped.predict("slow", [{"x": 1}])
        assert e.value.status == 504 and "deadline" in str(e.value)
        # Marked, so the parent answers with its deadline's 504 without reading the clock
        # again (the timer can fire a fraction of a ms early: serving_graph.py once answered
        # "gateway timeout" for a graph's request past its deadline).
        assert e.value.past_deadline
        assert slow.cancelled.is_set()  # the callee's work was ended, not left running

    asyncio.run(run())
    (sub,) = scoped.calls
    assert sub.status == 504 and 150 < sub.ms < 5000


def test_a_deadline_already_past_runs_nothing() -> None:
    gen = RecordingGenerate()
    scoped = client(gen).scoped(None, time.monotonic() - 1)
    with pytest.raises(FleetCallError) as e:
        asyncio.run(scoped.complete("gen", "hi"))
    assert e.value.status == 504 and e.value.past_deadline and gen.classes == []


def test_sub_calls_are_admitted_in_the_parents_class() -> None:
    gen = RecordingGenerate()
    scoped = client(gen).scoped("interactive", None)
    with pytest.raises(FleetCallError):
        asyncio.run(scoped.complete("gen", "hi", max_tokens=2))
    assert gen.classes == ["interactive"]
    assert [c.status for c in scoped.calls] == [400]
    with pytest.raises(FleetCallError) as e:
        asyncio.run(scoped.complete("gen", "hi", max_tokens=2))
    assert e.value.status == 400 and not e.value.past_deadline


def test_cancelling_the_parent_cancels_its_sub_calls() -> None:
    slow = SlowCustom("slow", 30.0)
    scoped = client(slow).scoped(None, None)

    async def run() -> None:
        async def handler() -> None:
            await asyncio.gather(
                scoped.predict("slow", [{"a": 1}]), scoped.predict("slow", [{"b": 2}])
            )

        parent = asyncio.create_task(handler())
        await asyncio.sleep(0.05)
        parent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parent
        assert slow.cancelled.is_set()

    asyncio.run(run())
    assert [c.status for c in scoped.calls] == [499, 499]


def test_a_sub_call_to_a_missing_model_names_the_fleet() -> None:
    scoped = client(SlowCustom("only", 0.0)).scoped(None, None)
    with pytest.raises(FleetCallError) as e:
        asyncio.run(scoped.chat("nope", [{"role": "user", "content": "hi"}]))
    assert e.value.status == 404 and "'nope' does not exist" in str(e.value)
    assert "only" in str(e.value)
    assert [(c.model, c.status) for c in scoped.calls] == [("nope", 404)]


class Classes:
    """A stand-in admission: interactive goes before batch; other names are unknown."""

    def resolve(self, name: str | None, priority: int) -> Any:
        table = {None: 0, "interactive": 0, "batch": 10}
        if name not in table:
            raise ValueError(f"unknown class {name!r}")

        class Cls:
            pass

        cls = Cls()
        cls.priority = table[name]  # type: ignore[attr-defined]
        return cls


def test_a_mixed_micro_batch_takes_the_strictest_class() -> None:
    gen = RecordingGenerate()
    gen.admission = Classes()  # type: ignore[attr-defined]
    registry = Registry([gen])  # type: ignore[list-item]
    assert strictest(registry, frozenset({"batch"})) == "batch"
    assert strictest(registry, frozenset()) is None
    assert strictest(registry, frozenset({"batch", "interactive"})) == "interactive"
    assert strictest(registry, frozenset({"batch", "nope"})) == "batch"
    # The default (None) ranks as the class it resolves to, ahead of a named equal.
    assert strictest(registry, frozenset({"batch", None})) is None


def test_a_stream_to_a_missing_model_is_a_clear_error() -> None:
    scoped = client(SlowCustom("only", 0.0)).scoped(None, None)

    async def run() -> None:
        with pytest.raises(FleetCallError) as e:
            async for _ in scoped.complete_stream("nope", "hi"):
                pass
        assert e.value.status == 404 and "'nope' does not exist" in str(e.value)
        with pytest.raises(FleetCallError) as e:
            async for _ in scoped.chat_stream("only", [{"role": "user", "content": "hi"}]):
                pass
        assert e.value.status == 400 and "custom model, not generate" in str(e.value)

    asyncio.run(run())
    assert [(c.method, c.status) for c in scoped.calls] == [
        ("complete_stream", 404),
        ("chat_stream", 400),
    ]
