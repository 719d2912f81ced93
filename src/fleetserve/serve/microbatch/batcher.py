"""Dynamic N-or-T batching for models that take a batch and answer it whole (embed, custom).

A batch runs when ``max_batch_size`` items wait or when the oldest has waited
``batch_wait_timeout_s``, whichever comes first; a long timeout therefore means static
batches of exactly N. One batch runs at a time, on the batcher's own worker thread, so the
event loop keeps accepting requests (and filling the next batch) while the model computes.

Failure isolation: if ``run_batch`` raises for a batch of several items, the items are run
again one at a time, so only the item that fails on its own fails. ``run_batch`` may also
put an ``Exception`` instance in an item's slot to fail that item alone.

A batcher belongs to the event loop of its first ``submit``; all methods but the
constructor are called on that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, ClassVar, Generic, TypeVar

from annotated_types import Ge, Le
from pydantic import Strict

T = TypeVar("T")
MAX_BATCH_SIZE = 4096
R = TypeVar("R")

logger = logging.getLogger(__name__)


class MicroBatchError(Exception):
    """Base of the batcher's own refusals (not the model's failures)."""


class MicroBatchOverloadedError(MicroBatchError):
    """`max_waiting` items already wait: the caller should retry later (HTTP 503)."""


class MicroBatchStoppedError(MicroBatchError):
    """The batcher is draining or stopped and takes no new items, or stopped before the
    item ran (HTTP 503)."""


class MicroBatchResultError(RuntimeError):
    """`run_batch` broke its contract: not one result per item."""


class MicroBatchItemError(Exception):
    """Raised by `submit_many` when one of its items failed; `error` is that item's."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"item {index}: {error}")
        self.index = index
        self.error = error


@dataclass(frozen=True)
class MicroBatchConfig:
    """A batch runs at `max_batch_size` items or `batch_wait_timeout_s` after its first;
    `max_waiting` items may wait. The fleet file's `batching:` section is this class
    (pydantic reads the annotations, so an error names its key), as is direct use."""

    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    max_batch_size: Annotated[int, Strict(), Ge(1), Le(MAX_BATCH_SIZE)] = 32
    batch_wait_timeout_s: Annotated[float, Strict(), Ge(0.0), Le(3600.0)] = 0.01
    max_waiting: Annotated[int, Strict(), Ge(1)] = 4096

    def __post_init__(self) -> None:
        size = self.max_batch_size
        if isinstance(size, bool) or not 1 <= size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be in [1, {MAX_BATCH_SIZE}], got {size}")
        if not 0 <= self.batch_wait_timeout_s <= 3600:
            raise ValueError(
                f"batch_wait_timeout_s must be in [0, 3600], got {self.batch_wait_timeout_s}"
            )
        if isinstance(self.max_waiting, bool) or self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")


@dataclass(eq=False)
class _Pending(Generic[T, R]):
    item: T
    future: asyncio.Future[R]
    enqueued_at: float  # loop.time()


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R | Exception]],
        *,
        max_batch_size: int,
        batch_wait_timeout_s: float,
        max_waiting: int,
        on_batch: Callable[[int, float], None] | None = None,
        name: str = "batcher",
    ) -> None:
        """`run_batch(items) -> one result (or Exception) per item, in order`; it runs on a
        worker thread. `on_batch(batch_size, seconds)` runs on the loop after each batch."""
        self.config = MicroBatchConfig(max_batch_size, batch_wait_timeout_s, max_waiting)
        self.name = name
        self._run_batch = run_batch
        self._on_batch = on_batch
        self._queue: deque[_Pending[T, R]] = deque()
        self._in_flight: list[_Pending[T, R]] = []
        # Called (on the loop) when every item of the running batch has been withdrawn:
        # nobody waits for its results any more (a custom model cancels its sub-calls).
        self.on_abandon: Callable[[], None] | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._state = "open"  # open -> draining -> stopped, or open -> stopped
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"batch-{name}")

    @property
    def num_waiting(self) -> int:
        """Items queued and not yet running (what `max_waiting` bounds)."""
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return len(self._in_flight)

    async def submit(self, item: T) -> R:
        """The item's result; raises its failure, or a `MicroBatchError` when refused."""
        self._admit(1)
        pending = self._enqueue(item)
        try:
            return await pending.future
        finally:
            self._withdraw(pending)

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """All of `items` (admitted together or not at all), results in order. The first
        failing item raises `MicroBatchItemError` and the others are withdrawn."""
        if not items:
            return []
        self._admit(len(items))
        pending = [self._enqueue(item) for item in items]
        try:
            futures = [p.future for p in pending]
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            for i, fut in enumerate(futures):
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise MicroBatchItemError(i, fut.exception())  # type: ignore[arg-type]
            return [fut.result() for fut in futures]
        finally:
            for p in pending:
                self._withdraw(p)

    async def drain(self) -> None:
        """Refuse new items, run every queued one (without waiting for the timeout), stop."""
        if self._state == "open":
            self._state = "draining"
        self._wakeup.set()
        await self._join(None)

    async def stop(self, timeout_s: float | None = None) -> None:
        """Refuse new items, fail the queued ones with `MicroBatchStoppedError`, and wait (up
        to `timeout_s`) for the running batch; past it, its items fail too."""
        self._state = "stopped"
        self._fail(list(self._queue), f"batcher {self.name!r} stopped before this item ran")
        self._queue.clear()
        self._wakeup.set()
        await self._join(timeout_s)

    async def _join(self, timeout_s: float | None) -> None:
        task = self._task
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except asyncio.TimeoutError:
                self._fail(self._in_flight, f"batcher {self.name!r} stopped while it ran")
                task.cancel()
        self._state = "stopped"
        self._executor.shutdown(wait=False)

    def _admit(self, n: int) -> None:
        if self._state != "open":
            raise MicroBatchStoppedError(f"{self.name} is {self._state} and takes no new items")
        if n > self.config.max_waiting:  # retrying would not help: the caller's to fix
            raise ValueError(
                f"{n} items in one request exceed what {self.name} queues "
                f"(max_waiting={self.config.max_waiting}); send fewer per request"
            )
        if len(self._queue) + n > self.config.max_waiting:
            raise MicroBatchOverloadedError(
                f"{self.name} is overloaded: {len(self._queue)} items wait and "
                f"{n} more would pass max_waiting={self.config.max_waiting}; retry later"
            )

    def _enqueue(self, item: T) -> _Pending[T, R]:
        loop = asyncio.get_running_loop()
        pending: _Pending[T, R] = _Pending(item, loop.create_future(), loop.time())
        self._queue.append(pending)
        if self._task is None:
            self._task = loop.create_task(self._loop(), name=f"batcher-{self.name}")
        self._wakeup.set()
        return pending

    def _withdraw(self, pending: _Pending[T, R]) -> None:
        """The submitter is done with this item: if it still waits (client gone), drop it."""
        if not pending.future.done():
            pending.future.cancel()
        if pending.future.cancelled():
            try:
                self._queue.remove(pending)
                self._wakeup.set()  # the oldest item may have changed
            except ValueError:  # already running: its result will be discarded
                running = self._in_flight
                if (
                    self.on_abandon is not None
                    and pending in running
                    and all(p.future.cancelled() for p in running)
                ):
                    self.on_abandon()
        else:
            pending.future.exception()  # mark retrieved: no "never retrieved" warning

    def _fail(self, pendings: list[_Pending[T, R]], message: str) -> None:
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(MicroBatchStoppedError(message))

    async def _loop(self) -> None:
        try:
            while (batch := await self._next_batch()) is not None:
                await self._run(batch)
        except BaseException as e:
            # A bug here (or an interpreter exit in run_batch) must not leave callers waiting.
            self._state = "stopped"
            self._fail(self._in_flight + list(self._queue), f"batcher {self.name!r} failed: {e!r}")
            self._queue.clear()
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("batcher %s crashed", self.name)
            raise

    async def _next_batch(self) -> list[_Pending[T, R]] | None:
        """Wait until a batch is due (N items, or the oldest waited T); None when done."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            if not self._queue:
                if self._state != "open":
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if len(self._queue) >= cfg.max_batch_size or self._state != "open":
                break
            remaining = self._queue[0].enqueued_at + cfg.batch_wait_timeout_s - loop.time()
            if remaining <= 0:
                break
            self._wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)
        n = min(cfg.max_batch_size, len(self._queue))
        return [self._queue.popleft() for _ in range(n)]

    async def _run(self, batch: list[_Pending[T, R]]) -> None:
        self._in_flight = batch
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        items = [p.item for p in batch]
        outcomes = await loop.run_in_executor(self._executor, self._run_isolated, items)
        seconds = time.perf_counter() - started
        for p, out in zip(batch, outcomes, strict=True):
            if p.future.done():  # its submitter left while it ran
                continue
            if isinstance(out, BaseException):
                p.future.set_exception(out)
            else:
                p.future.set_result(out)
        # Cleared only once every future is settled: if anything above raises, the loop's
        # handler still finds these items and fails them.
        self._in_flight = []
        if self._on_batch is not None:
            try:
                self._on_batch(len(batch), seconds)
            except Exception:  # a metrics hook must not stop the batcher
                logger.exception("on_batch hook of batcher %s failed", self.name)

    def _run_isolated(self, items: list[T]) -> list[R | Exception]:
        """Worker thread: the batch, or item by item if the batch as a whole raised."""
        try:
            return self._call(items)
        except Exception as e:
            if len(items) == 1:
                return [e]
        outcomes: list[R | Exception] = []
        for item in items:
            try:
                outcomes.extend(self._call([item]))
            except Exception as e:
                outcomes.append(e)
        return outcomes

    def _call(self, items: list[T]) -> list[R | Exception]:
        results = self._run_batch(items)
        if not isinstance(results, (list, tuple)) or len(results) != len(items):
            got = (
                f"{len(results)} results"
                if isinstance(results, (list, tuple))
                else (f"a {type(results).__name__}")
            )
            raise MicroBatchResultError(
                f"run_batch returned {got} for a batch of {len(items)} items"
            )
        return list(results)
