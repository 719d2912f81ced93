"""The Files API upload streams to disk: the chunked line checks agree with `split_input`
on every cut of a file, an IncomingFile leaves nothing behind unless committed, and a
32 MB upload through the real router (an ASGI app, its body sent in chunks) never has
more than a few MB of Python memory allocated at once, while its bytes land whole."""

from __future__ import annotations

import asyncio
import json
import os
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from fleetserve.batch.incoming import IncomingFile
from fleetserve.batch.lines import MAX_LINES, InputCheck, split_input
from fleetserve.batch.store import BatchStore
from fleetserve.entrypoints.openai.errors import APIError, error_response
from fleetserve.entrypoints.openai.serving_batch import batch_router

SAMPLES = [
    b'{"a": 1}\n{"b": 2}\n',
    b'{"a": 1}\r\n\r\n  \r\n{"b": "\xc3\xa9t\xc3\xa9"}',  # CRLF, blank lines, 2-byte chars
    b"one\rtwo\x0bthree\x1cfour\xe2\x80\xa8five",  # every break str.splitlines knows
    b"\n \n\t\n",
    b"",
    b"ok\n\xff\xfe\n",
    b"cut \xe2\x82",  # a character cut off at the end
    ("x\n" * (MAX_LINES + 1)).encode(),
]


def _chunked(data: bytes, size: int) -> int | str:
    check = InputCheck()
    try:
        for i in range(0, len(data), size):
            check.feed(data[i : i + size])
        return check.finish()
    except ValueError as e:
        return str(e)


def _whole(data: bytes) -> int | str:
    try:
        return len(split_input(data))
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("data", SAMPLES)
def test_chunked_check_agrees_with_split_input_on_every_cut(data: bytes) -> None:
    expected = _whole(data)
    sizes = [1, 2, 3, 7, len(data) or 1] if len(data) < 1000 else [4096, 65536]
    for size in sizes:
        got = _chunked(data, size)
        if isinstance(expected, str) and "lines; a batch holds at most" in expected:
            # Too many lines is refused as soon as there are: the count is not waited for.
            assert (
                got
                == f"the file has more than {MAX_LINES} lines; a batch holds at most {MAX_LINES}"
            )
        else:
            assert got == expected, (size, data)


def test_incoming_file_is_a_file_only_once_committed(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    dropped = IncomingFile(store)
    dropped.write(b"half")
    dropped.discard()
    kept = IncomingFile(store)
    kept.write(b'{"a": 1}\n')
    kept.write(b'{"b": 2}\n')
    record = kept.commit("in.jsonl", "batch")
    kept.discard()  # a no-op once committed
    assert (record.id, record.bytes, record.filename) == (kept.id, 18, "in.jsonl")
    assert store.read_file(kept.id) == b'{"a": 1}\n{"b": 2}\n'
    assert os.listdir(store.files_dir) == [kept.id]  # no .part, nothing of `dropped`
    assert store.get_file(dropped.id) is None
    store.close()


def _app(store: BatchStore, max_file_bytes: int) -> FastAPI:
    app = FastAPI()  # no lifespan: the batch worker is not needed to store files

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    app.include_router(
        batch_router(store, lambda: None, max_file_bytes=max_file_bytes)  # type: ignore[arg-type,return-value]
    )
    return app


BOUNDARY = "fleetserve-test-boundary"
LINE = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                   "body": {"prompt": "y" * 950}}).encode() + b"\n"  # fmt: skip


async def _body(num_chunks: int, lines_per_chunk: int, tail: bytes = b"") -> AsyncIterator[bytes]:
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    for _ in range(num_chunks):
        yield LINE * lines_per_chunk
    yield tail + f"\r\n--{BOUNDARY}--\r\n".encode()


async def _post(app: FastAPI, body: AsyncIterator[bytes]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post("/v1/files", content=body, headers=headers)


def test_a_large_upload_streams_to_disk_in_bounded_memory(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    app = _app(store, max_file_bytes=64 << 20)
    num_chunks, per_chunk = 512, 64  # 512 chunks of 64 lines of ~1 KB: 32 MB, 32,768 lines
    tracemalloc.start()
    try:
        r = asyncio.run(_post(app, _body(num_chunks, per_chunk)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status_code == 200, r.text
    size = num_chunks * per_chunk * len(LINE)
    assert r.json()["bytes"] == size and r.json()["filename"] == "big.jsonl"
    assert peak < 4 << 20, f"peak {peak} bytes for a {size}-byte upload"
    assert os.path.getsize(store.file_path(r.json()["id"])) == size
    with open(store.file_path(r.json()["id"]), "rb") as f:
        assert f.read(len(LINE)) == LINE
    assert len(split_input(store.read_file(r.json()["id"]))) == num_chunks * per_chunk
    store.close()


@pytest.mark.parametrize(
    ("num_chunks", "tail", "status", "message"),
    [
        (80, b"", 413, "the file is larger than 65536 bytes"),  # no Content-Length: mid-stream
        (1, b"\xff", 400, f"the file is not UTF-8 text (byte {16 * len(LINE)})"),
        (1, b"\r\n--" + BOUNDARY.encode() + b"\r\nno-colon-header\r\n", 400, "malformed multipart"),
    ],
)
def test_refused_uploads_leave_no_file(
    tmp_path: Path, num_chunks: int, tail: bytes, status: int, message: str
) -> None:
    store = BatchStore(str(tmp_path))
    app = _app(store, max_file_bytes=64 * 1024)
    r = asyncio.run(_post(app, _body(num_chunks, 16, tail)))
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert os.listdir(store.files_dir) == []
    assert store.list_files(None, 10)[0] == []
    store.close()


def test_a_cut_off_body_is_refused(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    app = _app(store, max_file_bytes=1 << 20)

    async def cut() -> AsyncIterator[bytes]:
        async for chunk in _body(2, 8):
            if chunk.endswith(b"--\r\n"):
                return  # the closing boundary never comes
            yield chunk

    r = asyncio.run(_post(app, cut()))
    assert r.status_code == 400
    assert "the body ended before its closing boundary" in r.json()["error"]["message"]
    assert os.listdir(store.files_dir) == []
    store.close()
