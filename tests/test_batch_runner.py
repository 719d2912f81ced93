"""The batch store and runner, through the LineExecutor seam (an in-test executor that
records what it ran): continuous streaming, exactly-once resume, cancel, expiry, retry."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from fleetserve.batch import runner as runner_mod
from fleetserve.batch.lines import CHAT_URL, BatchLine, LineResult, response_result
from fleetserve.batch.runner import LineAnswer, LineRetry, run_batch, stream_lines
from fleetserve.batch.store import BatchStore


def _input(n: int, bad: tuple[int, ...] = ()) -> bytes:
    out = []
    for i in range(n):
        if i in bad:
            out.append("{not json")
        else:
            body = {"messages": [{"role": "user", "content": f"q{i}"}]}
            out.append(
                json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT_URL, "body": body})
            )
    return ("\n".join(out) + "\n").encode()


def _new_batch(store: BatchStore, n: int, bad: tuple[int, ...] = ()) -> str:
    f = store.add_file(_input(n, bad), "in.jsonl", "batch")
    return store.create_batch(f.id, CHAT_URL, "24h").id


class Recorder:
    """Answers each line with its own custom_id; can hold lines until released."""

    def __init__(self, hold: set[str] | None = None) -> None:
        self.ran: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold = hold or set()
        self.release = asyncio.Event()

    async def __call__(self, line: BatchLine) -> LineAnswer:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if line.custom_id in self.hold:
                await self.release.wait()
            await asyncio.sleep(0)
            self.ran.append(line.custom_id)
            return LineAnswer(200, f"req-{line.custom_id}", {"echo": line.custom_id})
        finally:
            self.in_flight -= 1


def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an async test on a fresh event loop (the suite has no asyncio plugin)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


def _custom_ids(records: list[str]) -> list[str | None]:
    return [json.loads(r)["custom_id"] for r in records]


def _lines(n: int) -> list[BatchLine]:
    return [BatchLine(i, f"c{i}", CHAT_URL, {}) for i in range(n)]


@sync
async def test_stream_is_continuous_not_chunked() -> None:
    """A slow line holds one slot; every other line streams past it through the rest."""
    rec = Recorder(hold={"c0"})
    committed: list[LineResult] = []

    def commit(r: LineResult) -> None:
        committed.append(r)
        if len(committed) == 9:  # all but the slow one are done: now let it finish
            rec.release.set()

    left = await stream_lines(_lines(10), rec, commit, concurrency=3, stop=asyncio.Event())
    assert left == []
    assert rec.max_in_flight == 3
    assert [r.custom_id for r in committed][-1] == "c0"
    assert sorted(rec.ran) == sorted(f"c{i}" for i in range(10))


@sync
async def test_bad_concurrency_raises() -> None:
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        await stream_lines(_lines(1), Recorder(), lambda r: None, 0, asyncio.Event())


@sync
async def test_completes_with_outputs_errors_and_counts(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 6, bad=(2,))
    status = await run_batch(store, batch_id, Recorder(), concurrency=2)
    assert status == "completed"
    b = store.get_batch(batch_id)
    assert b is not None
    assert (b.status, b.total, b.completed, b.failed) == ("completed", 6, 5, 1)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.cancelled_at is None
    assert b.output_file_id and b.error_file_id
    out = store.read_file(b.output_file_id).decode().splitlines()
    assert _custom_ids(out) == ["c0", "c1", "c3", "c4", "c5"]
    first = json.loads(out[0])
    assert first["response"] == {"status_code": 200, "request_id": "req-c0", "body": {"echo": "c0"}}
    (err,) = store.read_file(b.error_file_id).decode().splitlines()
    assert json.loads(err)["error"]["message"].startswith("line 3 is not valid JSON")
    assert store.get_file(b.output_file_id).purpose == "batch_output"  # type: ignore[union-attr]


@sync
async def test_interrupted_run_resumes_exactly_once(tmp_path: Path) -> None:
    """Stop a run the hard way (its task cancelled mid-flight, the store never closed),
    open the state dir afresh and run again: each custom_id ends up exactly once, and no
    line committed before the interruption runs again."""
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 12)
    first = Recorder(hold={"c7", "c8"})
    task = asyncio.create_task(run_batch(store, batch_id, first, concurrency=3))
    while len(store.done_line_nos(batch_id)) < 7:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    committed = {f"c{i}" for i in store.done_line_nos(batch_id)}
    assert "c7" not in committed and "c8" not in committed
    assert store.get_batch(batch_id).status == "in_progress"  # type: ignore[union-attr]

    reopened = BatchStore(str(tmp_path))
    assert reopened.active_batch_ids() == [batch_id]
    second = Recorder()
    assert await run_batch(reopened, batch_id, second, concurrency=3) == "completed"
    assert committed.isdisjoint(second.ran)
    b = reopened.get_batch(batch_id)
    assert b is not None and b.completed == 12 and b.failed == 0
    out = reopened.read_file(b.output_file_id).decode().splitlines()  # type: ignore[arg-type]
    assert _custom_ids(out) == [f"c{i}" for i in range(12)]


@sync
async def test_cancel_stops_feeding_and_keeps_finished_lines(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 10)
    rec = Recorder(hold={"c3"})
    cancel = asyncio.Event()
    task = asyncio.create_task(run_batch(store, batch_id, rec, concurrency=2, cancel=cancel))
    while len(store.done_line_nos(batch_id)) < 3:
        await asyncio.sleep(0.01)
    store.request_cancel(batch_id)
    assert store.get_batch(batch_id).status == "cancelling"  # type: ignore[union-attr]
    cancel.set()
    assert await task == "cancelled"
    b = store.get_batch(batch_id)
    assert b is not None and b.status == "cancelled" and b.cancelling_at and b.cancelled_at
    assert b.completed == len(rec.ran) < 10
    out = store.read_file(b.output_file_id).decode().splitlines()  # type: ignore[arg-type]
    assert sorted(_custom_ids(out)) == sorted(rec.ran)  # type: ignore[type-var]
    assert store.request_cancel(batch_id).status == "cancelled"  # type: ignore[union-attr]


@sync
async def test_cancel_before_running_finalizes_empty(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 3)
    store.request_cancel(batch_id)
    rec = Recorder()
    assert await run_batch(store, batch_id, rec) == "cancelled"
    assert rec.ran == []


@sync
async def test_past_the_window_lines_expire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 3)
    monkeypatch.setattr(runner_mod.time, "time", lambda: 4e9)
    rec = Recorder()
    assert await run_batch(store, batch_id, rec) == "expired"
    assert rec.ran == []
    b = store.get_batch(batch_id)
    assert b is not None and b.failed == 3 and b.expired_at
    errs = store.read_file(b.error_file_id).decode().splitlines()  # type: ignore[arg-type]
    assert [json.loads(e)["error"]["code"] for e in errs] == ["batch_expired"] * 3


@sync
async def test_retry_then_answer(tmp_path: Path) -> None:
    tries: dict[str, int] = {}

    async def flaky(line: BatchLine) -> LineAnswer:
        tries[line.custom_id] = tries.get(line.custom_id, 0) + 1
        if tries[line.custom_id] < 3:
            raise LineRetry("busy", delay_s=0.001)
        return LineAnswer(200, "r", {})

    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 2)
    assert await run_batch(store, batch_id, flaky) == "completed"
    assert tries == {"c0": 3, "c1": 3}


@sync
async def test_executor_failure_leaves_the_batch_to_resume(tmp_path: Path) -> None:
    async def dead(line: BatchLine) -> LineAnswer:
        raise RuntimeError("engine gone")

    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 3)
    with pytest.raises(RuntimeError, match="engine gone"):
        await run_batch(store, batch_id, dead)
    assert store.get_batch(batch_id).status == "in_progress"  # type: ignore[union-attr]
    assert await run_batch(store, batch_id, Recorder()) == "completed"


@sync
async def test_unusable_input_fails_the_batch(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    f = store.add_file(b"\xff", "in.jsonl", "batch")
    batch_id = store.create_batch(f.id, CHAT_URL, "24h").id
    assert await run_batch(store, batch_id, Recorder()) == "failed"
    b = store.get_batch(batch_id)
    assert b is not None and b.failed_at and b.errors
    assert b.to_api()["errors"]["data"][0]["code"] == "invalid_file"


def test_store_refuses_a_second_result_for_a_line_or_custom_id(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 2)
    line = BatchLine(0, "c0", CHAT_URL, {})
    assert store.commit_result(batch_id, response_result(line, 200, "r", {"n": 1}))
    assert not store.commit_result(batch_id, response_result(line, 200, "r", {"n": 2}))
    same_id = BatchLine(1, "c0", CHAT_URL, {})
    assert not store.commit_result(batch_id, response_result(same_id, 200, "r", {"n": 3}))
    (record,) = store.results(batch_id)
    assert json.loads(record)["response"]["body"] == {"n": 1}
    assert store.get_batch(batch_id).completed == 1  # type: ignore[union-attr]


def test_list_pages_newest_first(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    ids = [_new_batch(store, 1) for _ in range(5)]
    page, more = store.list_batches(None, 2)
    assert [b.id for b in page] == ids[::-1][:2] and more
    page, more = store.list_batches(page[-1].id, 2)
    assert [b.id for b in page] == ids[::-1][2:4] and more
    page, more = store.list_batches(page[-1].id, 2)
    assert [b.id for b in page] == [ids[0]] and not more
    with pytest.raises(ValueError, match="after: no batch"):
        store.list_batches("batch_nope", 2)
    with pytest.raises(ValueError, match="completion_window"):
        store.create_batch("f", CHAT_URL, "1h")


def test_files_page_and_an_input_in_use_is_not_deleted(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 1)
    input_id = store.get_batch(batch_id).input_file_id  # type: ignore[union-attr]
    other = store.add_file(b"x\n", "x.jsonl", "batch")
    page, more = store.list_files(None, 1)
    assert [f.id for f in page] == [other.id] and more
    assert [f.id for f in store.list_files(other.id, 5)[0]] == [input_id]
    with pytest.raises(ValueError, match="still running"):
        store.delete_file(input_id)
    assert store.delete_file(other.id) and not store.delete_file(other.id)
    assert not Path(store.file_path(other.id)).exists()
