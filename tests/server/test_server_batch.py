"""The Batch API through the official `openai` client, against a real uvicorn server with a
real tiny engine: chat/completions/embeddings lines, a malformed line, upload errors,
paging, cancel, and kill -9 of the server mid-batch then a restart on the same state dir."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_proc import free_port

HELPER = os.path.join(os.path.dirname(__file__), "batch_server.py")
CHAT = "/v1/chat/completions"


class BatchServer:
    def __init__(self, model: str, state_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, HELPER, "--model", model, "--state-dir", str(state_dir),
               "--port", str(self.port), *extra]  # fmt: skip
        # Its own session: kill() takes the engine process down with it, as a node loss would.
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, "the batch server exited during start-up"
            assert time.monotonic() < deadline, "the batch server did not get ready"
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchServer]:
    srv = BatchServer(tiny_llama, tmp_path_factory.mktemp("batch-state"))
    try:
        yield srv
    finally:
        srv.kill()


def _line(custom_id: str, content: str, max_tokens: int = 8, **body: Any) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **body}  # fmt: skip
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def _upload(client: openai.OpenAI, lines: list[str]) -> str:
    f = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    return f.id


def _wait(client: openai.OpenAI, batch_id: str, until: Any, timeout_s: float = 180) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch stuck: {b.status} {b.request_counts}"
        time.sleep(0.1)


def _jsonl(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_chat_batch_end_to_end_with_bad_lines(server: BatchServer) -> None:
    c = server.client
    lines = [_line(f"q{i}", f"tell me about {i}") for i in range(6)]
    lines += ["{not json", _line("bad", "x", top_p=5.0)]
    file_id = _upload(c, lines)
    f = c.files.retrieve(file_id)
    assert (f.purpose, f.filename, f.object) == ("batch", "in.jsonl", "file")
    assert f.bytes == len(("\n".join(lines) + "\n").encode())
    batch = c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                             metadata={"job": "e2e"})  # fmt: skip
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "e2e"}
    done = _wait(c, batch.id, lambda b: b.status == "completed")
    assert (done.request_counts.total, done.request_counts.completed) == (8, 6)
    assert done.request_counts.failed == 2
    assert done.in_progress_at and done.completed_at and done.output_file_id
    out = _jsonl(c, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(6)]
    # Each answer is what the same body sent to /v1/chat/completions gets.
    body = json.loads(lines[2])["body"]
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    got = out[2]["response"]["body"]
    assert got["choices"] == direct["choices"] and got["usage"] == direct["usage"]
    assert got["object"] == "chat.completion" and got["id"] == out[2]["response"]["request_id"]
    assert done.error_file_id is not None
    errs = _jsonl(c, done.error_file_id)
    assert [e["custom_id"] for e in errs] == [None, "bad"]
    assert "line 7 is not valid JSON" in errs[0]["error"]["message"]
    assert errs[1]["response"]["status_code"] == 400 and "top_p" in errs[1]["error"]["message"]
    assert c.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_completions_and_embeddings_batches(server: BatchServer) -> None:
    c = server.client
    cmpl = [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": f"Item {i}:", "max_tokens": 4}}) for i in range(3)]  # fmt: skip
    b1 = c.batches.create(input_file_id=_upload(c, cmpl), endpoint="/v1/completions",
                          completion_window="24h")  # fmt: skip
    emb = [json.dumps({"custom_id": "e0", "method": "POST", "url": "/v1/embeddings",
                       "body": {"input": "hello", "model": "tiny"}})]  # fmt: skip
    b2 = c.batches.create(input_file_id=_upload(c, emb), endpoint="/v1/embeddings",
                          completion_window="24h")  # fmt: skip
    d1 = _wait(c, b1.id, lambda b: b.status == "completed")
    out = _jsonl(c, d1.output_file_id)
    assert [o["response"]["body"]["object"] for o in out] == ["text_completion"] * 3
    assert all(o["response"]["body"]["usage"]["completion_tokens"] <= 4 for o in out)
    d2 = _wait(c, b2.id, lambda b: b.status == "completed")
    assert d2.request_counts.failed == 1
    (err,) = _jsonl(c, d2.error_file_id)
    # The registry's answer, as over HTTP: the model exists but is not an embed model.
    assert err["response"]["status_code"] == 400
    assert "'tiny' is a generate model; this endpoint serves embed" in err["error"]["message"]


def test_upload_and_create_errors(server: BatchServer) -> None:
    c = server.client
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        c.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="not UTF-8"):
        c.files.create(file=("a.jsonl", b"\xff\xfe\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="no lines"):
        c.files.create(file=("a.jsonl", b"\n\n"), purpose="batch")
    with pytest.raises(openai.APIStatusError, match="larger than") as big:
        c.files.create(file=("a.jsonl", b"x" * (1 << 20) + b"\n"), purpose="batch")
    assert big.value.status_code == 413
    # Just under the limit: it streams to disk in many chunks and comes back byte for byte.
    body = {"messages": [{"role": "user", "content": "é" * 480}], "max_tokens": 1}
    lines = [
        json.dumps({"custom_id": f"n{i}", "method": "POST", "url": CHAT, "body": body},
                   ensure_ascii=False)
        for i in range(880)
    ]  # fmt: skip
    data = ("\n".join(lines) + "\n").encode()  # 2-byte characters cut across chunks
    assert (1 << 20) - 128 * 1024 < len(data) <= 1 << 20
    whole = c.files.create(file=("big.jsonl", data), purpose="batch")
    assert whole.bytes == len(data) and c.files.content(whole.id).content == data
    with pytest.raises(openai.BadRequestError, match="purpose"):  # file first, then refused
        c.files.create(file=("a.jsonl", data), purpose="fine-tune")
    r = httpx.post(f"{server.url}/v1/files", json={"purpose": "batch"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        c.batches.cancel("batch_nope")
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        c.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    file_id = _upload(c, [_line("a", "x")])
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        c.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="limit"):
        c.batches.list(limit=0)


def test_list_is_paged_newest_first(server: BatchServer) -> None:
    c = server.client
    file_id = _upload(c, [_line("a", "x", max_tokens=1)])
    ids = [
        c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id
        for _ in range(3)
    ]
    page = c.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert page.first_id == ids[2] and page.last_id == ids[1]
    seen = [b.id for b in c.batches.list(limit=2)]  # the client follows `after` itself
    assert seen[:3] == ids[::-1] and len(seen) == len(set(seen))
    for batch_id in ids:
        _wait(c, batch_id, lambda b: b.status == "completed")


def test_cancel_mid_batch(server: BatchServer) -> None:
    c = server.client
    lines = [_line(f"k{i}", f"story {i}", max_tokens=64) for i in range(40)]
    batch = c.batches.create(input_file_id=_upload(c, lines), endpoint=CHAT,
                             completion_window="24h")  # fmt: skip
    _wait(c, batch.id, lambda b: b.request_counts.completed >= 2)
    first = c.batches.cancel(batch.id)
    assert first.status in ("cancelling", "cancelled") and first.cancelling_at
    done = _wait(c, batch.id, lambda b: b.status == "cancelled")
    assert done.cancelled_at and done.request_counts.completed < 40
    out = _jsonl(c, done.output_file_id)
    assert len(out) == done.request_counts.completed
    assert len({o["custom_id"] for o in out}) == len(out)
    assert c.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


def _committed(state_dir: Path) -> dict[str, str]:
    with sqlite3.connect(f"file:{state_dir / 'batch.db'}?mode=ro", uri=True, timeout=5) as conn:
        return dict(conn.execute("SELECT custom_id, record FROM results").fetchall())


def test_kill9_mid_batch_then_restart_is_exactly_once(tiny_llama: str, tmp_path: Path) -> None:
    n = 24
    lines = [_line(f"id-{i}", f"count to {i}", max_tokens=24) for i in range(n)]
    first = BatchServer(tiny_llama, tmp_path, "--concurrency", "2", "--max-num-seqs", "2")
    try:
        c = first.client
        batch = c.batches.create(input_file_id=_upload(c, lines), endpoint=CHAT,
                                 completion_window="24h")  # fmt: skip
        _wait(c, batch.id, lambda b: b.request_counts.completed >= 3)
    finally:
        first.kill()
    before = _committed(tmp_path)
    assert 3 <= len(before) < n, "the server must be killed mid-batch"

    second = BatchServer(tiny_llama, tmp_path, "--concurrency", "2", "--max-num-seqs", "2")
    try:
        done = _wait(second.client, batch.id, lambda b: b.status == "completed")
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        out = _jsonl(second.client, done.output_file_id)
    finally:
        second.kill()
    assert [o["custom_id"] for o in out] == [f"id-{i}" for i in range(n)]
    by_id = {o["custom_id"]: o for o in out}
    # What was committed before the kill is in the output as it was (not run again).
    assert all(by_id[cid] == json.loads(rec) for cid, rec in before.items())


def test_files_list_and_delete(server: BatchServer) -> None:
    c = server.client
    a = _upload(c, [_line("a", "x")])
    b = _upload(c, [_line("b", "y")])
    listed = [f.id for f in c.files.list(purpose="batch")]
    assert listed.index(b) < listed.index(a)  # newest first
    page = c.files.list(limit=1)
    assert [f.id for f in page.data] == [b] and page.has_more
    deleted = c.files.delete(a)
    assert deleted.id == a and deleted.deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(a)
    with pytest.raises(openai.NotFoundError):
        c.files.delete(a)
    assert a not in [f.id for f in c.files.list(purpose="batch")]


def test_fleetserve_serve_mounts_the_batch_api(tiny_llama: str, tmp_path: Path) -> None:
    """`fleetserve serve` itself (not the helper app) answers the Files and Batch API,
    keeping its state in --state-dir."""
    from server_proc import ServerProc

    state = tmp_path / "state"
    srv = ServerProc(tiny_llama, "--served-model-name", "tiny", "--state-dir", str(state))
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        lines = [_line(f"q{i}", f"question {i}") for i in range(3)]
        batch = client.batches.create(
            input_file_id=_upload(client, lines), endpoint=CHAT, completion_window="24h"
        )
        done = _wait(client, batch.id, lambda b: b.status == "completed")
        assert done.request_counts.completed == 3 and done.request_counts.failed == 0
        out = _jsonl(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == ["q0", "q1", "q2"]
        assert (state / "files").is_dir()
    finally:
        assert srv.stop() == 0, srv.final_output
