"""A Batch API line is held to the limits of an HTTP request, and a batch that keeps
taking its server down is failed rather than resumed forever (the poison pill)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fleetserve.batch.jobs import MAX_CRASHED_RUNS, BatchJobs
from fleetserve.batch.lines import (
    CHAT_URL,
    LINE_ENVELOPE_BYTES,
    BatchLine,
    LineError,
    parse_file,
    parse_lines,
)
from fleetserve.batch.runner import run_batch
from fleetserve.batch.store import BatchStore
from test_batch_runner import Recorder, _new_batch


def _line(custom_id: str, content: str) -> str:
    body = {"messages": [{"role": "user", "content": content}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body})


def test_a_line_past_the_body_limit_is_an_error_line_not_read_whole(tmp_path: Path) -> None:
    limit = 10_000
    path = tmp_path / "in.jsonl"
    huge = _line("huge", "x" * (limit + LINE_ENVELOPE_BYTES))
    at_limit = _line("fits", "y" * (limit - 200))
    path.write_text("\n".join([_line("a", "hi"), huge, at_limit, "", _line("b", "yo")]) + "\n")
    items = parse_file(str(path), CHAT_URL, limit)
    assert [type(x) for x in items] == [BatchLine, LineError, BatchLine, BatchLine]
    assert [x.line_no for x in items] == [0, 1, 2, 4]
    err = items[1]
    assert isinstance(err, LineError)
    assert f"line 2 is {len(huge) + 1} bytes" in err.message
    assert f"at most {limit} bytes" in err.message
    # Without a limit, the same lines as the in-memory parser.
    assert parse_file(str(path), CHAT_URL) == parse_lines(path.read_bytes(), CHAT_URL)


def test_line_numbers_match_the_in_memory_parser(tmp_path: Path) -> None:
    # Every line break str.splitlines knows, blank lines, CRLF, no final newline.
    text = "\r\n".join([_line("a", "1"), "", _line("b", "2\u2028")]) + "\r" + _line("c", "3")
    text += "\u2029\n\n" + _line("d", "4")
    path = tmp_path / "in.jsonl"
    path.write_bytes(text.encode())
    assert parse_file(str(path), CHAT_URL, 1 << 20) == parse_lines(text.encode(), CHAT_URL)


def test_a_batch_that_keeps_killing_its_server_is_failed(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 4)
    # Runs that began and never ended: each a server that died running the batch.
    for crashes in range(MAX_CRASHED_RUNS):
        assert store.begin_run(batch_id) == crashes
    recorder = Recorder()

    async def restart() -> None:
        jobs = BatchJobs(store, lambda: recorder, 2)
        await jobs.start()
        for _ in range(200):
            b = store.get_batch(batch_id)
            assert b is not None
            if b.status == "failed":
                break
            await asyncio.sleep(0.01)
        await jobs.stop()

    asyncio.run(restart())
    batch = store.get_batch(batch_id)
    assert batch is not None and batch.status == "failed" and batch.errors
    assert batch.errors[0]["code"] == "batch_crashed"
    assert recorder.ran == []  # not run again


def test_runs_that_end_with_their_process_are_not_crashes(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    batch_id = _new_batch(store, 3)
    for _ in range(MAX_CRASHED_RUNS + 2):  # stopped and restarted, gracefully
        assert store.begin_run(batch_id) == 0
        store.end_run(batch_id)
    store.begin_run(batch_id)  # one kill -9
    assert store.begin_run(batch_id) == 1
    store.end_run(batch_id)

    async def run() -> str:
        return await run_batch(store, batch_id, Recorder(), 2)

    assert asyncio.run(run()) == "completed"
