"""NoReplicaWait: requests of a model without a replica wait for one up to
migration_wait_s, counted from when the model lost its last replica and from their own
arrival, whichever is later; then they are shed with a 503's ShedError."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetserve.serve.admission.admit import ShedError
from fleetserve.serve.admission.replica_wait import SHED_REASON, NoReplicaWait
from fleetserve.serve.admission.sla import ClassQueue, ServiceClass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Payload:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[Any] = loop.create_future()


def test_requests_wait_for_a_replica_up_to_the_bound() -> None:
    loop = asyncio.new_event_loop()
    try:
        clock = Clock()
        classes = {
            "interactive": ServiceClass("interactive", 0, 10),
            "batch": ServiceClass("batch", 10, 10),
        }
        queue: ClassQueue[Payload] = ClassQueue(classes, "interactive")
        shed: list[tuple[str, str]] = []
        live = [True]
        wait = NoReplicaWait(
            "chat", queue, lambda: live[0], lambda c, r: shed.append((c, r)), 10.0, clock=clock
        )

        def push(cls: str) -> Payload:
            p = Payload(loop)
            queue.push(p, cls, 0, clock.now)
            return p

        old = push("interactive")  # waits for room while a replica is up
        clock.now = 130.0
        assert wait.step() == 0 and wait.since is None
        live[0] = False  # the last replica is gone at 130
        early = push("batch")
        assert wait.step() == 0 and wait.since == 130.0
        clock.now = 135.0
        late = push("interactive")
        assert wait.step() == 0  # 5 s without a replica: everyone still waits
        clock.now = 140.0
        # 10 s without a replica: `old` (waited 40 s) and `early` (10 s) go; `late` waited 5.
        assert wait.step() == 2
        assert sorted(shed) == [("batch", SHED_REASON), ("interactive", SHED_REASON)]
        for p in (old, early):
            err = p.future.exception()
            assert isinstance(err, ShedError) and err.code == SHED_REASON
            assert "no replica of 'chat' came up within 10 s" in str(err)
        assert not late.future.done() and len(queue) == 1
        live[0] = True  # a replica came: nothing more is shed, and the clock restarts
        clock.now = 200.0
        assert wait.step() == 0 and wait.since is None and len(queue) == 1
        live[0] = False
        clock.now = 205.0
        assert wait.step() == 0  # `late` waited 70 s, but the model lacks a replica for 0 s
        clock.now = 215.0
        assert wait.step() == 1 and isinstance(late.future.exception(), ShedError)
        assert len(queue) == 0 and queue.peek() is None
    finally:
        loop.close()


def test_a_request_taken_out_meanwhile_is_not_shed() -> None:
    loop = asyncio.new_event_loop()
    try:
        clock = Clock()
        queue: ClassQueue[Payload] = ClassQueue({"d": ServiceClass("d", 0, 10)}, "d")
        gone, stays = Payload(loop), Payload(loop)
        entry = queue.push(gone, "d", 0, clock.now)
        queue.push(stays, "d", 0, clock.now + 1)
        queue.remove(entry)  # its client left
        wait = NoReplicaWait("m", queue, lambda: False, lambda c, r: None, 0.0, clock=clock)
        clock.now += 1
        assert wait.step() == 1
        assert not gone.future.done() and isinstance(stays.future.exception(), ShedError)
    finally:
        loop.close()


def test_bad_bounds_are_refused() -> None:
    queue: ClassQueue[Payload] = ClassQueue({"d": ServiceClass("d", 0, 10)}, "d")
    with pytest.raises(ValueError, match="wait_s"):
        NoReplicaWait("m", queue, lambda: False, lambda c, r: None, -1.0)
