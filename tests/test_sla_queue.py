"""The SLA class queue without a model: order (class, request priority, deadline,
arrival), per-class bounds, deadlines, removal; a table of cases and a property test
against a plain sorted-list model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.serve.admission.sla import (
    REQUEST_PRIORITY_SPAN,
    ClassQueue,
    QueueFullError,
    ServiceClass,
    engine_priority,
)

CLASSES = {
    "interactive": ServiceClass("interactive", priority=0, max_waiting=3, max_queue_time_s=5.0),
    "batch": ServiceClass("batch", priority=10, max_waiting=5),
}


def queue() -> ClassQueue[str]:
    return ClassQueue(CLASSES, "interactive")


def drain(q: ClassQueue[str]) -> list[str]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e.payload)
    return out


def test_class_priority_then_request_priority_then_arrival() -> None:
    q = queue()
    q.push("b1", "batch", 0, now=0.0)
    q.push("i1", "interactive", 0, now=1.0)
    q.push("b2", "batch", -5, now=2.0)  # more important than b1 within batch
    q.push("i2", "interactive", 0, now=3.0)
    q.push("i0", "interactive", -1, now=4.0)
    assert [e.payload for e in q] == ["i0", "i1", "i2", "b2", "b1"]
    assert drain(q) == ["i0", "i1", "i2", "b2", "b1"]
    assert len(q) == 0


def test_bounds_are_per_class() -> None:
    q = queue()
    for i in range(3):
        q.push(f"i{i}", "interactive", 0, now=0.0)
    with pytest.raises(QueueFullError, match="'interactive' queue is full"):
        q.push("i3", "interactive", 0, now=0.0)
    for i in range(5):  # batch has its own room
        q.push(f"b{i}", "batch", 0, now=0.0)
    with pytest.raises(QueueFullError):
        q.push("b5", "batch", 0, now=0.0)
    assert (q.num_waiting("interactive"), q.num_waiting("batch")) == (3, 5)
    q.pop()  # frees one interactive place
    q.push("i3", "interactive", 0, now=0.0)
    assert q.num_waiting("interactive") == 3


def test_deadlines_expire_only_classes_with_a_max_queue_time() -> None:
    q = queue()
    a = q.push("a", "interactive", 0, now=0.0)
    q.push("batch", "batch", 0, now=0.0)
    q.push("b", "interactive", 0, now=2.0)
    assert (a.deadline, q.next_deadline()) == (5.0, 5.0)
    assert q.expire(4.99) == []
    assert [e.payload for e in q.expire(5.0)] == ["a"]
    assert q.next_deadline() == 7.0
    assert [e.payload for e in q.expire(100.0)] == ["b"]
    assert q.next_deadline() == math.inf  # batch has no deadline
    assert drain(q) == ["batch"]


def test_removed_entries_are_skipped_and_free_their_place() -> None:
    q = queue()
    a = q.push("a", "interactive", 0, now=0.0)
    q.push("b", "interactive", 0, now=1.0)
    assert q.remove(a) and not q.remove(a)
    assert q.num_waiting("interactive") == 1
    assert q.expire(1000.0)[0].payload == "b"  # a does not expire: it is gone
    assert q.pop() is None


def test_unknown_class_and_default() -> None:
    q = queue()
    assert q.resolve(None).name == "interactive"
    with pytest.raises(
        ValueError,
        match="service_tier 'gold' is not a service class here .*; classes: batch, inter",
    ):
        q.resolve("gold")
    with pytest.raises(ValueError, match="default_class 'x'"):
        ClassQueue(CLASSES, "x")
    with pytest.raises(ValueError, match="classes.c.max_waiting"):
        ServiceClass("c", max_waiting=-1)


def test_engine_priority_orders_class_before_request_priority() -> None:
    inter, batch = CLASSES["interactive"], CLASSES["batch"]
    worst_interactive = engine_priority(inter, 2**31 - 1)
    best_batch = engine_priority(batch, -(2**31))
    assert worst_interactive < best_batch
    assert engine_priority(batch, 3) == 10 * REQUEST_PRIORITY_SPAN + 3


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(["interactive", "batch"]), st.integers(-2, 2)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_queue_matches_a_sorted_list_model(program: list[tuple]) -> None:  # type: ignore[type-arg]
    q = queue()
    now = 0.0
    model: list[tuple[tuple[int, int, float, int], str]] = []  # (key, payload)
    entries = []
    for n, op in enumerate(program):
        if op[0] == "push":
            cls = CLASSES[op[1]]
            full = sum(1 for _, p in model if p.startswith(op[1])) >= cls.max_waiting
            try:
                e = q.push(f"{op[1]}-{n}", op[1], op[2], now)
            except QueueFullError:
                assert full
                continue
            assert not full
            entries.append(e)
            model.append((e.key, e.payload))
        elif op[0] == "pop":
            e = q.pop()
            if not model:
                assert e is None
            else:
                best = min(model)
                model.remove(best)
                assert e is not None and e.payload == best[1]
        elif op[0] == "remove" and entries:
            e = entries[op[1] % len(entries)]
            was_queued = any(p == e.payload for _, p in model)
            assert q.remove(e) == was_queued
            model = [(k, p) for k, p in model if p != e.payload]
        elif op[0] == "tick":
            now += op[1]
            gone = {e.payload for e in q.expire(now)}
            expected = {p for k, p in model if k[2] <= now}
            assert gone == expected
            model = [(k, p) for k, p in model if k[2] > now]
        assert len(q) == len(model)
        assert [e.payload for e in q] == [p for _, p in sorted(model)]
        for name in CLASSES:
            assert q.num_waiting(name) == sum(1 for _, p in model if p.startswith(name))
        deadlines = [k[2] for k, _ in model]
        assert q.next_deadline() == min(deadlines, default=math.inf)
