"""MicroBatcher without a model: a fake run_batch that records every batch it is given."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.serve.microbatch.batcher import (
    MicroBatchConfig,
    MicroBatcher,
    MicroBatchItemError,
    MicroBatchOverloadedError,
    MicroBatchResultError,
    MicroBatchStoppedError,
)

LONG = 3600.0  # a timeout no test waits for: batches form only by size, drain or stop


class Recorder:
    """run_batch that doubles each item, fails items in `bad`, and logs the batches."""

    def __init__(self, bad: set[int] | None = None, sleep_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.bad = bad or set()
        self.sleep_s = sleep_s
        self.active = 0
        self.max_active = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, items: list[int]) -> list[int]:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.threads.add(threading.current_thread().name)
            self.batches.append(list(items))
            if self.sleep_s:
                time.sleep(self.sleep_s)
            hit = self.bad.intersection(items)
            if hit:
                raise ValueError(f"bad item {sorted(hit)[0]}")
            return [2 * x for x in items]
        finally:
            with self._lock:
                self.active -= 1


def make(
    run: Callable[[list[int]], Sequence[object]],
    max_batch_size: int = 4,
    timeout: float = LONG,
    max_waiting: int = 100,
    **kw: object,
) -> MicroBatcher:
    return MicroBatcher(
        run,  # type: ignore[arg-type]
        max_batch_size=max_batch_size,
        batch_wait_timeout_s=timeout,
        max_waiting=max_waiting,
        **kw,  # type: ignore[arg-type]
    )


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_concurrent_submits_form_batches_up_to_max() -> None:
    rec = Recorder()
    sizes: list[int] = []

    async def main() -> list[int]:
        b = make(rec, max_batch_size=8, timeout=0.05, on_batch=lambda n, s: sizes.append(n))
        out = await asyncio.gather(*(b.submit(i) for i in range(20)))
        await b.stop()
        return list(out)

    assert asyncio.run(main()) == [2 * i for i in range(20)]
    assert [len(x) for x in rec.batches] == [8, 8, 4]
    assert sizes == [8, 8, 4]
    assert [x for batch in rec.batches for x in batch] == list(range(20))
    assert rec.max_active == 1
    assert all(name.startswith("batch-") for name in rec.threads)


def test_a_lone_item_waits_the_timeout_then_runs() -> None:
    rec = Recorder()

    async def main() -> tuple[int, float]:
        b = make(rec, max_batch_size=8, timeout=0.2)
        t0 = time.perf_counter()
        out = await b.submit(21)
        return out, time.perf_counter() - t0

    out, elapsed = asyncio.run(main())
    assert out == 42
    assert rec.batches == [[21]]
    # It waited for batch-mates (>= T), and not for ever (a generous bound for a busy CPU).
    assert 0.19 <= elapsed < 10


def test_static_batching_waits_for_exactly_n() -> None:
    rec = Recorder()

    async def main() -> None:
        b = make(rec, max_batch_size=4)
        first = [asyncio.create_task(b.submit(i)) for i in range(3)]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in first) and rec.batches == []
        assert b.num_waiting == 3
        last = await b.submit(3)
        assert last == 6 and [t.result() for t in first] == [0, 2, 4]
        await b.stop()

    asyncio.run(main())
    assert rec.batches == [[0, 1, 2, 3]]


def test_event_loop_stays_free_while_a_batch_runs() -> None:
    rec = Recorder(sleep_s=0.3)

    async def main() -> int:
        b = make(rec, max_batch_size=1)
        ticks = 0
        task = asyncio.create_task(b.submit(1))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return ticks

    assert asyncio.run(main()) >= 5


def test_cancelled_submit_drops_its_item() -> None:
    rec = Recorder()

    async def main() -> None:
        b = make(rec, max_batch_size=3)
        a = asyncio.create_task(b.submit(1))
        gone = asyncio.create_task(b.submit(2))
        await settle()
        assert b.num_waiting == 2
        gone.cancel()  # the client went away before its batch formed
        await settle()
        assert b.num_waiting == 1
        assert await b.submit_many([3, 4]) == [6, 8]
        assert await a == 2
        await b.stop()

    asyncio.run(main())
    assert rec.batches == [[1, 3, 4]]


def test_item_cancelled_while_running_is_discarded() -> None:
    rec = Recorder(sleep_s=0.2)

    async def main() -> None:
        b = make(rec, max_batch_size=2)
        a = asyncio.create_task(b.submit(1))
        gone = asyncio.create_task(b.submit(2))
        await asyncio.sleep(0.05)
        assert b.num_running == 2
        gone.cancel()
        assert await a == 2
        assert await b.submit_many([5, 6]) == [10, 12]
        await b.stop()

    asyncio.run(main())
    assert rec.batches == [[1, 2], [5, 6]]


def test_a_failing_item_fails_alone() -> None:
    rec = Recorder(bad={3})

    async def main() -> list[object]:
        b = make(rec, max_batch_size=4)
        return await asyncio.gather(*(b.submit(i) for i in range(4)), return_exceptions=True)

    out = asyncio.run(main())
    assert out[:3] == [0, 2, 4]
    assert isinstance(out[3], ValueError) and "bad item 3" in str(out[3])
    # The whole batch once, then each item alone.
    assert rec.batches == [[0, 1, 2, 3], [0], [1], [2], [3]]


def test_an_exception_in_a_slot_fails_that_item_only() -> None:
    calls: list[list[int]] = []

    def run(items: list[int]) -> list[object]:
        calls.append(items)
        return [KeyError(x) if x % 2 else x for x in items]

    async def main() -> list[object]:
        b = make(run, max_batch_size=4)
        return await asyncio.gather(*(b.submit(i) for i in range(4)), return_exceptions=True)

    out = asyncio.run(main())
    assert out[0] == 0 and out[2] == 2
    assert isinstance(out[1], KeyError) and isinstance(out[3], KeyError)
    assert calls == [[0, 1, 2, 3]]  # no re-run: the batch itself succeeded


def test_wrong_number_of_results_fails_with_a_clear_error() -> None:
    async def main() -> list[object]:
        b = make(lambda items: items[:1] if len(items) > 1 else [], max_batch_size=2)
        return await asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True)

    out = asyncio.run(main())
    assert all(isinstance(e, MicroBatchResultError) for e in out)
    assert "returned 0 results for a batch of 1 items" in str(out[0])


def test_max_waiting_bounds_the_queue() -> None:
    rec = Recorder()

    async def main() -> None:
        b = make(rec, max_batch_size=10, max_waiting=3)
        tasks = [asyncio.create_task(b.submit(i)) for i in range(3)]
        await settle()
        with pytest.raises(MicroBatchOverloadedError, match="max_waiting=3"):
            await b.submit(9)
        with pytest.raises(MicroBatchOverloadedError):
            await b.submit_many([7, 8])  # all or nothing
        with pytest.raises(ValueError, match="4 items in one request exceed"):
            await b.submit_many([1, 2, 3, 4])  # could never fit: not worth a retry
        assert b.num_waiting == 3
        await b.drain()
        assert [t.result() for t in tasks] == [0, 2, 4]

    asyncio.run(main())
    assert rec.batches == [[0, 1, 2]]


def test_drain_runs_queued_items_and_then_refuses() -> None:
    rec = Recorder()

    async def main() -> None:
        b = make(rec, max_batch_size=2)
        tasks = [asyncio.create_task(b.submit(i)) for i in range(5)]
        await settle()
        await b.drain()
        assert [t.result() for t in tasks] == [0, 2, 4, 6, 8]
        with pytest.raises(MicroBatchStoppedError, match="takes no new items"):
            await b.submit(1)

    asyncio.run(main())
    assert rec.batches == [[0, 1], [2, 3], [4]]


def test_stop_fails_queued_items_clearly() -> None:
    rec = Recorder()

    async def main() -> list[object]:
        b = make(rec, max_batch_size=10)
        tasks = [asyncio.create_task(b.submit(i)) for i in range(2)]
        await settle()
        await b.stop()
        return await asyncio.gather(*tasks, return_exceptions=True)

    out = asyncio.run(main())
    assert all(isinstance(e, MicroBatchStoppedError) for e in out)
    assert "stopped before this item ran" in str(out[0])
    assert rec.batches == []


def test_stop_with_a_timeout_fails_a_batch_that_runs_too_long() -> None:
    rec = Recorder(sleep_s=1.0)

    async def main() -> object:
        b = make(rec, max_batch_size=1)
        task = asyncio.create_task(b.submit(1))
        await asyncio.sleep(0.1)
        await b.stop(timeout_s=0.05)
        return (await asyncio.gather(task, return_exceptions=True))[0]

    out = asyncio.run(main())
    assert isinstance(out, MicroBatchStoppedError) and "while it ran" in str(out)


def test_submit_many_names_the_failing_index_and_withdraws_the_rest() -> None:
    rec = Recorder(bad={12})

    async def main() -> None:
        b = make(rec, max_batch_size=2)
        with pytest.raises(MicroBatchItemError) as info:
            await b.submit_many([10, 11, 12, 13, 14])
        assert info.value.index == 2 and isinstance(info.value.error, ValueError)
        await settle()
        assert b.num_waiting == 0
        await b.stop()

    asyncio.run(main())
    # 10,11 ran; 12,13 failed as a batch and were re-run alone; 14 was withdrawn unrun.
    assert rec.batches == [[10, 11], [12, 13], [12], [13]]


def test_on_batch_hook_failure_does_not_stop_the_batcher() -> None:
    def hook(n: int, s: float) -> None:
        raise RuntimeError("metrics down")

    async def main() -> list[int]:
        b = make(Recorder(), max_batch_size=1, on_batch=hook)
        return [await b.submit(1), await b.submit(2)]

    assert asyncio.run(main()) == [2, 4]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_batch_size", {"max_batch_size": 0}),
        ("batch_wait_timeout_s", {"batch_wait_timeout_s": -1.0}),
        ("max_waiting", {"max_waiting": 0}),
    ],
)
def test_config_errors_name_the_field(field: str, kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=field):
        MicroBatchConfig(**kwargs)  # type: ignore[arg-type]


# Each step: pause this long (ms), then submit this many items at once.
schedules = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6)), min_size=1, max_size=8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules, max_batch_size=st.integers(1, 5), timeout_ms=st.integers(0, 5))
def test_every_item_runs_once_in_order_within_the_size_bound(
    schedule: list[tuple[int, int]], max_batch_size: int, timeout_ms: int
) -> None:
    rec = Recorder()

    async def main() -> tuple[list[int], list[int]]:
        b = make(rec, max_batch_size=max_batch_size, timeout=timeout_ms / 1000)
        tasks: list[asyncio.Task[int]] = []
        next_item = 0
        for pause_ms, n in schedule:
            await asyncio.sleep(pause_ms / 1000)
            for _ in range(n):
                tasks.append(asyncio.create_task(b.submit(next_item)))
                next_item += 1
        out = await asyncio.gather(*tasks)
        await b.stop()
        return list(out), list(range(next_item))

    out, items = asyncio.run(main())
    assert out == [2 * x for x in items]
    assert all(1 <= len(batch) <= max_batch_size for batch in rec.batches)
    assert [x for batch in rec.batches for x in batch] == items
