"""Runs a batch's unfinished lines through an executor as one continuous stream.

Up to `concurrency` lines are in flight; the next starts as soon as one finishes (no
waiting for a chunk to drain), so the engine's continuous batching always has work.
Each finished line is committed to the store before anything else happens, so whatever
stops the run (cancel, kill -9, a dead engine) loses only the lines in flight, and a
later run skips every committed line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from fleetserve.batch.lines import (
    BatchLine,
    LineError,
    LineResult,
    error_result,
    invalid_result,
    parse_file,
    response_result,
)
from fleetserve.batch.store import BatchStore

DEFAULT_CONCURRENCY = 64
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@dataclass(frozen=True)
class LineAnswer:
    """What an endpoint answered for one line (as an HTTP call would have)."""

    status_code: int
    request_id: str
    body: dict[str, Any]


class LineRetry(Exception):
    """The line could not be tried now (engine busy or loading): try it again later."""

    def __init__(self, reason: str, delay_s: float = 0.5) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class LineExecutor(Protocol):
    """Runs one line. Contract: every answer about the line itself, good or bad (a 400
    for a bad body, a 500 for a failure of this one request), is returned; LineRetry
    means "not now"; any other exception means nothing can run (the engine is gone), and
    the run stops with the line uncommitted, to resume in a later run."""

    async def __call__(self, line: BatchLine) -> LineAnswer: ...


OnResult = Callable[[LineResult], None]


async def stream_lines(
    lines: Iterable[BatchLine],
    execute: LineExecutor,
    commit: OnResult,
    concurrency: int,
    stop: asyncio.Event,
    deadline: float | None = None,
) -> list[BatchLine]:
    """Runs `lines` with at most `concurrency` in flight, calling `commit` as each
    finishes. Returns the lines never started (stopped, or past the wall-clock
    `deadline`); lines in flight when `stop` is set are abandoned uncommitted."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = iter(lines)
    unstarted: list[BatchLine] = []
    in_flight: set[asyncio.Task[None]] = set()
    stop_waiter = asyncio.ensure_future(stop.wait())
    try:
        while True:
            while len(in_flight) < concurrency and not stop.is_set():
                line = next(pending, None)
                if line is None:
                    break
                if deadline is not None and time.time() >= deadline:
                    unstarted.append(line)
                    continue
                in_flight.add(asyncio.create_task(_run_one(line, execute, commit)))
            if not in_flight or stop.is_set():
                break
            done, _ = await asyncio.wait(
                in_flight | {stop_waiter}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task is not stop_waiter:
                    in_flight.discard(task)  # type: ignore[arg-type]
                    task.result()  # an executor failure stops the run here
    finally:
        stop_waiter.cancel()
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
    unstarted.extend(pending)
    return unstarted


async def _run_one(line: BatchLine, execute: LineExecutor, commit: OnResult) -> None:
    while True:
        try:
            answer = await execute(line)
            break
        except LineRetry as e:
            await asyncio.sleep(e.delay_s)
    # No await between the answer and the commit: a cancelled run either has this
    # line's result committed or not, never half.
    commit(response_result(line, answer.status_code, answer.request_id, answer.body))


async def run_batch(
    store: BatchStore,
    batch_id: str,
    execute: LineExecutor,
    concurrency: int = DEFAULT_CONCURRENCY,
    cancel: asyncio.Event | None = None,
    on_result: OnResult | None = None,
    max_body_bytes: int | None = None,
) -> str:
    """Takes a batch from wherever it stopped to a final status, which it returns
    (completed, cancelled, expired or failed). Raises what the executor raised if the
    run cannot go on; the batch then stays in progress for a later run.
    `max_body_bytes`: a line's body may be no larger than an HTTP request's (an error line
    otherwise, never read whole)."""
    cancel = cancel or asyncio.Event()
    batch = store.get_batch(batch_id)
    if batch is None:
        raise ValueError(f"no batch with id {batch_id!r}")
    # Reading and parsing the file takes time in proportion to it: off the event loop.
    if not await asyncio.to_thread(validate, store, batch_id, max_body_bytes):
        return "failed"
    batch = store.get_batch(batch_id)
    assert batch is not None
    if batch.status == "in_progress":
        done = store.done_line_nos(batch_id)
        valid = await asyncio.to_thread(_valid_lines, store, batch, max_body_bytes)
        todo = [line for line in valid if line.line_no not in done]

        def commit(result: LineResult) -> None:
            if store.commit_result(batch_id, result) and on_result is not None:
                on_result(result)

        never_ran = await stream_lines(
            todo, execute, commit, concurrency, cancel, deadline=batch.expires_at
        )
        batch = store.get_batch(batch_id)
        assert batch is not None
        if cancel.is_set() or batch.status == "cancelling":
            store.finalize(batch_id, "cancelled")
            return "cancelled"
        if never_ran:
            expired = [
                error_result(x.line_no, x.custom_id, "batch_expired", EXPIRED_MESSAGE)
                for x in never_ran
            ]
            store.finalize(batch_id, "expired", expired)
            return "expired"
        store.finalize(batch_id, "completed")
        return "completed"
    if batch.status == "cancelling":
        store.finalize(batch_id, "cancelled")
        return "cancelled"
    if batch.status == "finalizing":
        store.finalize(batch_id, "completed")
        return "completed"
    return batch.status


def validate(store: BatchStore, batch_id: str, max_body_bytes: int | None = None) -> bool:
    """validating -> in_progress (unusable lines already in the error set) or -> failed
    (the file as a whole is unusable). False if the batch failed; a no-op past validating."""
    batch = store.get_batch(batch_id)
    if batch is None or batch.status == "failed":
        return False
    if batch.status != "validating":
        return True
    try:
        items = parse_file(store.file_path(batch.input_file_id), batch.endpoint, max_body_bytes)
    except (ValueError, OSError) as e:
        error = {"code": "invalid_file", "message": str(e), "param": None, "line": None}
        store.set_status(batch_id, "failed", errors=[error])
        return False
    invalid = [invalid_result(x) for x in items if isinstance(x, LineError)]
    store.start_batch(batch_id, len(items), invalid)
    return True


def _valid_lines(store: BatchStore, batch: Any, max_body_bytes: int | None) -> list[BatchLine]:
    items = parse_file(store.file_path(batch.input_file_id), batch.endpoint, max_body_bytes)
    return [x for x in items if isinstance(x, BatchLine)]
