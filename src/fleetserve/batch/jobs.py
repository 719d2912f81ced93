"""The server's batch worker: runs queued batches one after another in the background.

Batches run in creation order, one at a time, each with up to `concurrency` lines in
flight: one engine gains nothing from two batches at once, and the older batch finishes
first. At start-up every batch left active by the previous process (killed, restarted)
is queued again and resumes from its committed lines, unless runs of it ended with their
process MAX_CRASHED_RUNS times (a poison pill: something in it kills the server): then it
is marked failed, with what finished written out, instead of crash-looping the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from fleetserve.batch.records import BatchRecord
from fleetserve.batch.runner import DEFAULT_CONCURRENCY, LineExecutor, run_batch
from fleetserve.batch.store import BatchStore

log = logging.getLogger(__name__)

MAX_CRASHED_RUNS = 3


class BatchJobs:
    """Owns the background task; safe to call only from the event loop that ran start()."""

    def __init__(
        self,
        store: BatchStore,
        executor_factory: Callable[[], LineExecutor],
        concurrency: int = DEFAULT_CONCURRENCY,
        max_body_bytes: int | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.store = store
        self.executor_factory = executor_factory
        self.concurrency = concurrency
        self.max_body_bytes = max_body_bytes  # a line's body limit: the HTTP one
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._cancels: dict[str, asyncio.Event] = {}  # batch id -> its cancel signal
        self._worker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for batch_id in self.store.active_batch_ids():
            self.enqueue(batch_id)
        self._worker = asyncio.create_task(self._work())

    async def stop(self) -> None:
        """Stops at once: lines in flight are abandoned uncommitted and run again after
        the next start."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None

    def enqueue(self, batch_id: str) -> None:
        self._cancels[batch_id] = asyncio.Event()
        self._queue.put_nowait(batch_id)

    def cancel(self, batch_id: str) -> BatchRecord | None:
        """Marks the batch cancelling; its run stops feeding lines, abandons those in
        flight and writes out what finished. None if there is no such batch."""
        batch = self.store.request_cancel(batch_id)
        event = self._cancels.get(batch_id)
        if batch is not None and batch.status == "cancelling" and event is not None:
            event.set()
        return batch

    async def _work(self) -> None:
        while True:
            batch_id = await self._queue.get()
            cancel = self._cancels[batch_id]
            crashes = self.store.begin_run(batch_id)
            try:
                if crashes >= MAX_CRASHED_RUNS:
                    log.error("batch %s: failed (%d runs ended with the server)", batch_id, crashes)
                    self.store.fail_batch(
                        batch_id,
                        "batch_crashed",
                        f"the server stopped {crashes} times while running this batch (killed, "
                        "or out of memory); it is not run again",
                    )
                    continue
                status = await run_batch(
                    self.store, batch_id, self.executor_factory(), self.concurrency, cancel,
                    max_body_bytes=self.max_body_bytes,
                )  # fmt: skip
                log.info("batch %s: %s", batch_id, status)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 -- the batch stays active; a restart resumes it
                log.exception("batch %s stopped; it resumes when the server restarts", batch_id)
            finally:
                self.store.end_run(batch_id)
                self._cancels.pop(batch_id, None)
