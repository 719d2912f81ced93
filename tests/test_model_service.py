"""GenerateService without engine processes: fake engines behind real LocalReplicas, so
the class queue, the per-level seats, shedding, cancellation and the replica set's
add/drain/remove are checked with exact counts and orders (no timing)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError
from fleetserve.engine.delta_stream import DeltaStream
from fleetserve.metrics import ServerMetrics
from fleetserve.outputs import CompletionOutput, RequestOutput
from fleetserve.serve.admission.admit import ShedError
from fleetserve.serve.admission.sla import REQUEST_PRIORITY_SPAN, ServiceClass, oversubscription
from fleetserve.serve.config.fleet_config import ModelEntry, ResilienceConfig
from fleetserve.serve.replicas.local import LocalReplica
from fleetserve.serve.resilience.migration import MigrationLimitError
from fleetserve.serve.services.generate import GenerateService

CLASSES = {
    "interactive": ServiceClass("interactive", priority=0, max_waiting=2, max_queue_time_s=0.2),
    "batch": ServiceClass("batch", priority=10, max_waiting=4),
}


class FakeStream(DeltaStream):
    """The engine client's stream (engine/delta_stream.py), fed by the test."""

    def __init__(self, engine: FakeEngine, request_id: str, n: int) -> None:
        super().__init__(request_id, n, lambda s: engine.aborted.append(s.request_id))

    def finish(self) -> None:
        out = CompletionOutput(0, "x", [7], "length")
        self.deltas.put(RequestOutput(self.request_id, None, [1], [out], True))


class FakeEngine:
    """AsyncEngine's surface as LocalReplica and GenerateService use it."""

    def __init__(self) -> None:
        self.is_ready = False
        self.on_stats = None
        self.num_kv_blocks = 1000
        self.config = SimpleNamespace(cache=SimpleNamespace(block_size=16))
        self.dead_reason: str | None = None
        self.crashed = False
        self.sent: list[tuple[str, int]] = []  # (request id, engine priority)
        self.streams: dict[str, FakeStream] = {}
        self.aborted: list[str] = []
        self.on_notice = None
        self.core_pid = None
        self.lora_loaded: frozenset[str] = frozenset()

    def kill(self) -> None:
        self.dead_reason = "killed"

    async def start(self, timeout_s: float = 0.0) -> None:
        self.is_ready = True

    async def shutdown(self) -> None:
        self.is_ready = False
        self.dead_reason = "stopped"

    def add_request(
        self, rid: str, prompt: Any, params: SamplingParams, priority: int, resume: Any = None
    ) -> Any:
        self.sent.append((rid, priority))
        self.streams[rid] = FakeStream(self, rid, params.n)
        return self.streams[rid]

    def abort(self, rid: str) -> None:
        self.streams[rid].close()

    def abort_all(self, reason: str) -> None:
        for s in self.streams.values():
            s.fail(EngineDeadError(reason))


class Service(GenerateService):
    def _new_replica(self, index: int, pool: Any = None) -> LocalReplica:
        return LocalReplica(
            index,
            FakeEngine(),  # type: ignore[arg-type]
            max_num_seqs=self.config.scheduler.max_num_seqs,
            oversubscribe=oversubscription(self.queue.classes),
        )


def service(
    model: str,
    policy: str = "priority",
    replicas: int = 1,
    classes: dict[str, ServiceClass] = CLASSES,
) -> Service:
    metrics = ServerMetrics().model("m")
    # Replicas are added and removed by hand here: no replacement, no waiting for one.
    resilience = ResilienceConfig(replace_failed=False, migration_wait_s=0.0)
    entry = ModelEntry(
        name="m",
        model=model,
        engine={"max_num_seqs": 2, "scheduling_policy": policy},
        replicas=replicas,
        resilience=resilience,
    )
    return Service(entry, classes, "interactive", metrics=metrics)


def engine(svc: GenerateService, index: int = 0) -> FakeEngine:
    return svc.replica_set.get(index).engine  # type: ignore[return-value]


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 20))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def admit(svc: GenerateService, rid: str, cls: str | None, priority: int = 0) -> asyncio.Task:  # type: ignore[type-arg]
    params = SamplingParams(max_tokens=4)
    return asyncio.ensure_future(svc.admit(rid, ["hello"], lambda: params, cls, priority))


async def drain_streams(task: asyncio.Task) -> None:  # type: ignore[type-arg]
    """Consumes a request's streams to the end (the handler's part)."""
    for s in task.result():
        async for _ in s:
            pass


def test_classes_get_seats_per_level_and_go_in_priority_order(tiny_llama: str) -> None:
    async def main() -> None:
        svc = service(tiny_llama)
        await svc.start()
        eng = engine(svc)
        batch = [admit(svc, f"b{i}", "batch") for i in range(4)]
        await settle()
        # Two batch requests fill the batch; two wait in the class queue.
        assert [rid for rid, _ in eng.sent] == ["b0-0", "b1-0"]
        assert (svc.num_waiting("batch"), svc.queue.num_waiting("batch")) == (4, 2)
        inter = [admit(svc, f"i{i}", None) for i in range(3)]  # the default class
        await settle()
        # Interactive work is not blocked by batch work: two go at once (the engine's
        # priority scheduler preempts batch ones for them); the third waits, ahead of batch.
        assert [rid for rid, _ in eng.sent[2:]] == ["i0-0", "i1-0"]
        assert dict(eng.sent)["i0-0"] == 0 and dict(eng.sent)["b0-0"] == 10 * REQUEST_PRIORITY_SPAN
        assert [e.payload.items[0].request_id for e in svc.queue] == ["i2-0", "b2-0", "b3-0"]
        # A batch request ends: its seat is a batch-level seat, interactive i2 still waits
        # (two interactive sequences hold this level's batch).
        eng.streams["b0-0"].finish()
        await drain_streams(batch[0])
        await settle()
        assert [rid for rid, _ in eng.sent[4:]] == []
        eng.streams["i0-0"].finish()
        await drain_streams(inter[0])
        await settle()
        assert [rid for rid, _ in eng.sent[4:]] == ["i2-0"]
        for rid, task in [("i1-0", inter[1]), ("i2-0", inter[2]), ("b1-0", batch[1])]:
            eng.streams[rid].finish()
            await drain_streams(task)
        await settle()
        assert [rid for rid, _ in eng.sent[5:]] == ["b2-0", "b3-0"]
        assert len(svc.queue) == 0 and svc.num_waiting("batch") == 2
        await svc.shutdown()

    run(main)


def test_an_oversubscribed_class_fills_its_seats_and_leaves_interactive_ones(
    tiny_llama: str,
) -> None:
    """batch with oversubscribe 2.5 (max_num_seqs 2): five batch sequences go to the
    engine (three wait in its queue, not here); interactive still gets its two seats."""
    classes = {**CLASSES, "batch": ServiceClass("batch", priority=10, oversubscribe=2.5)}
    assert oversubscription(classes) == {10: 2.5}

    async def main() -> None:
        svc = service(tiny_llama, classes=classes)
        await svc.start()
        eng = engine(svc)
        batch = [admit(svc, f"b{i}", "batch") for i in range(7)]
        await settle()
        assert [rid for rid, _ in eng.sent] == [f"b{i}-0" for i in range(5)]
        assert (svc.num_waiting("batch"), svc.queue.num_waiting("batch")) == (7, 2)
        inter = [admit(svc, f"i{i}", "interactive") for i in range(3)]
        await settle()
        # The interactive level counts only its own: two seats, the third waits here.
        assert [rid for rid, _ in eng.sent[5:]] == ["i0-0", "i1-0"]
        assert svc.queue.num_waiting("interactive") == 1
        # Seven sequences held: a finished batch one frees no batch seat (5 is the level's
        # cap over itself and interactive), a finished interactive one lets i2 in.
        eng.streams["b0-0"].finish()
        await drain_streams(batch[0])
        await settle()
        assert len(eng.sent) == 7
        eng.streams["i0-0"].finish()
        await drain_streams(inter[0])
        await settle()
        assert [rid for rid, _ in eng.sent[7:]] == ["i2-0"]
        for rid, task in [("i1-0", inter[1]), ("i2-0", inter[2]), ("b1-0", batch[1])]:
            eng.streams[rid].finish()
            await drain_streams(task)
        await settle()
        # Now three batch sequences are held: both queued ones go (3 + 2 = 5).
        assert [rid for rid, _ in eng.sent[8:]] == ["b5-0", "b6-0"]
        assert len(svc.queue) == 0
        await svc.shutdown()

    run(main)


def test_oversubscribe_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="classes.batch.oversubscribe must be >= 1"):
        ServiceClass("batch", oversubscribe=0.5)
    with pytest.raises(ValueError, match="oversubscribe of level 3 must be >= 1, got 0.5"):
        LocalReplica(0, FakeEngine(), oversubscribe={3: 0.5})  # type: ignore[arg-type]


def test_full_class_queue_and_queue_time_shed_with_exact_counts(tiny_llama: str) -> None:
    async def main() -> None:
        svc = service(tiny_llama)
        await svc.start()
        running = [admit(svc, f"i{i}", "interactive") for i in range(2)]  # the batch
        queued = [admit(svc, f"q{i}", "interactive") for i in range(2)]  # max_waiting=2
        over = [admit(svc, f"x{i}", "interactive") for i in range(3)]
        await settle()
        for t in over:
            with pytest.raises(ShedError, match="'interactive' queue is full") as e:
                t.result()
            assert e.value.code == "overloaded"
        # Nothing frees a seat: after max_queue_time_s the two queued ones are shed,
        # never having reached the engine.
        for t in queued:
            with pytest.raises(ShedError, match="waited 0.2 s in the 'interactive' queue"):
                await t
        assert [rid for rid, _ in engine(svc).sent] == ["i0-0", "i1-0"]
        assert svc.num_waiting("interactive") == 2  # sent, not started
        text = svc.metrics.server.render().decode()  # type: ignore[union-attr]
        assert 'reason="queue_full"} 3.0' in text and 'reason="queue_timeout"} 2.0' in text
        assert all(not t.done() or t.exception() is None for t in running)
        await svc.shutdown()

    run(main)


def test_cancelled_wait_leaves_the_queue(tiny_llama: str) -> None:
    async def main() -> None:
        svc = service(tiny_llama)
        await svc.start()
        [admit(svc, f"b{i}", "batch") for i in range(2)]
        waiting = admit(svc, "w", "batch")
        await settle()
        assert svc.queue.num_waiting("batch") == 1
        waiting.cancel()  # the client left
        await settle()
        assert svc.queue.num_waiting("batch") == 0 and len(engine(svc).sent) == 2
        await svc.shutdown()

    run(main)


def test_bad_class_and_priority_under_fcfs_are_refused(tiny_llama: str) -> None:
    async def main() -> None:
        svc = service(tiny_llama, policy="fcfs")
        await svc.start()
        with pytest.raises(ValueError, match="service_tier 'gold' is not a service class"):
            await admit(svc, "a", "gold")
        with pytest.raises(
            ValueError, match="priority is not honoured by 'm': it schedules first-come"
        ):
            await admit(svc, "a", None, priority=3)
        await admit(svc, "ok", None, priority=0)
        await svc.shutdown()
        prio = service(tiny_llama, policy="priority")
        await prio.start()
        await admit(prio, "p", "batch", priority=-3)
        assert engine(prio).sent == [("p-0", 10 * REQUEST_PRIORITY_SPAN - 3)]
        await prio.shutdown()

    run(main)


def test_replicas_added_and_drained_while_serving(tiny_llama: str) -> None:
    async def main() -> None:
        svc = service(tiny_llama, replicas=1)
        await svc.start()
        first = [admit(svc, f"a{i}", "batch") for i in range(3)]
        await settle()
        assert svc.queue.num_waiting("batch") == 1  # replica 0 is full
        new = await svc.replica_set.add()  # the queued request goes to the new replica
        await settle()
        assert new.index == 1 and [rid for rid, _ in engine(svc, 1).sent] == ["a2-0"]
        # Drain replica 0: it gets nothing new, finishes what it holds, then leaves.
        drain = asyncio.ensure_future(svc.replica_set.drain(0, timeout_s=10))
        await settle()
        more = admit(svc, "b", "batch")
        await settle()
        assert [rid for rid, _ in engine(svc, 1).sent] == ["a2-0", "b-0"]
        for t, rid in zip(first[:2], ["a0-0", "a1-0"], strict=True):
            engine(svc, 0).streams[rid].finish()
            await drain_streams(t)
        assert await drain is True
        assert [r.index for r in svc.replica_set] == [1] and svc.is_ready
        await svc.replica_set.remove(1)  # the last one: its requests end, the model is down
        with pytest.raises(EngineDeadError):
            await drain_streams(more)
        assert not svc.is_ready and svc.dead_reason is not None
        with pytest.raises(EngineDeadError):
            await admit(svc, "late", "batch")

    run(main)


def test_migration_moves_a_lost_request_until_its_limit(tiny_llama: str) -> None:
    async def main() -> None:
        svc = service(tiny_llama, replicas=2)
        svc.resilience = ResilienceConfig(replace_failed=False, migration_limit=1)
        await svc.start()
        task = admit(svc, "m", "batch")
        await settle()
        [stream] = task.result()
        first = stream.state.replica_index
        other = 1 - first
        # Its replica is lost: it goes on on the other one, resumed from what was seen.
        engine(svc, first).streams["m-0"].fail(ReplicaGoneError("died"))
        consumer = asyncio.ensure_future(stream.__anext__())
        await settle()
        assert stream.state.replica_index == other and stream.state.migrations == 1
        assert [rid for rid, _ in engine(svc, other).sent] == ["m-0"]
        # Lost again: past migration_limit=1, a clear error instead of a third replica.
        engine(svc, other).streams["m-0"].fail(ReplicaGoneError("died again"))
        with pytest.raises(MigrationLimitError, match="migration_limit of 1"):
            await consumer
        await svc.shutdown()

    run(main)
