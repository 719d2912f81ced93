"""OpenAI's Files and Batches API (the part batches need), as a router to mount.

    POST /v1/files                 multipart upload (purpose "batch")
    GET  /v1/files                 newest first, paged by `after` / `limit`, `purpose`
    DELETE /v1/files/{id}          (409 while an unfinished batch reads it)
    GET  /v1/files/{id}            the File object
    GET  /v1/files/{id}/content    its bytes (inputs, outputs, error files)
    POST /v1/batches               create from an uploaded file
    GET  /v1/batches               newest first, paged by `after` / `limit`
    GET  /v1/batches/{id}
    POST /v1/batches/{id}/cancel

The router's lifespan starts the background worker (resuming batches a previous process
left unfinished) and stops it on shutdown; mounting the router with
`app.include_router(...)` merges that lifespan into the app's.

The upload is multipart, not JSON, so it does its own front-door checks (upload.py):
media type, size (413 before and while reading), a read timeout between chunks; the
file streams to disk as it arrives (batch/incoming.py), checked on the way to be UTF-8
JSONL with 1..50,000 lines, and becomes a File only once whole and valid. A browser can
send a multipart form cross-site without a preflight; that only stores a file of bounded
size: starting a batch needs a JSON body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fleetserve.batch.incoming import IncomingFile
from fleetserve.batch.jobs import BatchJobs
from fleetserve.batch.lines import ENDPOINTS, InputCheck
from fleetserve.batch.runner import DEFAULT_CONCURRENCY, LineExecutor
from fleetserve.batch.store import BatchStore
from fleetserve.entrypoints.openai.body import read_json
from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.serving_common import parse, shorten
from fleetserve.entrypoints.openai.upload import read_upload

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
MAX_METADATA_PAIRS = 16


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_PAIRS)


def batch_router(
    store: BatchStore,
    executor_factory: Callable[[], LineExecutor],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_body_bytes: int = 1024 * 1024,
    read_timeout_s: float = 15.0,
) -> APIRouter:
    """`executor_factory()` is called as each batch starts running, after the app's own
    start-up, so it may hand out an engine that the app creates in its lifespan."""
    jobs = BatchJobs(store, executor_factory, concurrency, max_body_bytes)
    routes = _BatchRoutes(store, jobs, max_file_bytes, max_body_bytes, read_timeout_s)
    router = APIRouter(lifespan=_lifespan(jobs))
    router.batch_jobs = jobs  # type: ignore[attr-defined]  # for the lead's drain and tests
    router.add_api_route("/v1/files", routes.upload_file, methods=["POST"])
    router.add_api_route("/v1/files", routes.list_files, methods=["GET"])
    router.add_api_route("/v1/files/{file_id}", routes.delete_file, methods=["DELETE"])
    router.add_api_route("/v1/files/{file_id}", routes.get_file, methods=["GET"])
    router.add_api_route("/v1/files/{file_id}/content", routes.file_content, methods=["GET"])
    router.add_api_route("/v1/batches", routes.create_batch, methods=["POST"])
    router.add_api_route("/v1/batches", routes.list_batches, methods=["GET"])
    router.add_api_route("/v1/batches/{batch_id}", routes.get_batch, methods=["GET"])
    router.add_api_route("/v1/batches/{batch_id}/cancel", routes.cancel_batch, methods=["POST"])
    return router


def _lifespan(jobs: BatchJobs) -> Any:
    """Starts the batch worker with the app (resuming unfinished batches); stops it after."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await jobs.start()
        try:
            yield
        finally:
            await jobs.stop()

    return lifespan


class _BatchRoutes:
    """The Files and Batches handlers over one store and its jobs (one method a route)."""

    def __init__(
        self,
        store: BatchStore,
        jobs: BatchJobs,
        max_file_bytes: int,
        max_body_bytes: int,
        read_timeout_s: float,
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.max_file_bytes = max_file_bytes
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def upload_file(self, request: Request) -> Response:
        incoming = IncomingFile(self.store)
        check = InputCheck()

        def sink(chunk: bytes) -> None:
            check.feed(chunk)
            incoming.write(chunk)

        try:
            try:
                upload = await read_upload(request, sink, self.max_file_bytes, self.read_timeout_s)
                purpose = upload.fields.get("purpose")
                if purpose != "batch":
                    shown = shorten(str(purpose))
                    raise APIError(400, f"purpose must be 'batch'; got {shown!r}", "purpose")
                if upload.file_field != "file":
                    raise APIError(400, "file is required (a multipart file field)", "file")
                check.finish()
            except ValueError as e:  # the line checks, as the file went by
                raise APIError(400, str(e), "file") from None
            filename = upload.filename or "upload.jsonl"
            record = await asyncio.to_thread(incoming.commit, filename, purpose)
        finally:
            incoming.discard()
        return JSONResponse(record.to_api())

    async def list_files(
        self, after: str | None = None, limit: str = "10000", purpose: str | None = None
    ) -> Response:
        try:
            page, has_more = self.store.list_files(after, _limit(limit, 10_000), purpose)
        except ValueError as e:
            raise APIError(400, str(e), "after") from None
        return _page([f.to_api() for f in page], has_more)

    async def delete_file(self, file_id: str) -> Response:
        try:
            deleted = self.store.delete_file(file_id)
        except ValueError as e:
            raise APIError(409, str(e), code="file_in_use") from None
        if not deleted:
            raise _not_found("File", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def get_file(self, file_id: str) -> Response:
        return JSONResponse(_file(self.store, file_id).to_api())

    async def file_content(self, file_id: str) -> Response:
        record = _file(self.store, file_id)
        path = self.store.file_path(record.id)
        return FileResponse(path, media_type="application/octet-stream")

    async def create_batch(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes, self.read_timeout_s)
        req = parse(CreateBatchRequest, body)
        if req.endpoint not in ENDPOINTS:
            raise APIError(
                400,
                f"endpoint must be one of {', '.join(ENDPOINTS)}; got {shorten(req.endpoint)!r}",
                "endpoint",
            )
        if req.completion_window != "24h":
            raise APIError(400, "completion_window must be '24h'", "completion_window")
        source = self.store.get_file(req.input_file_id)
        if source is None or source.purpose != "batch":
            raise APIError(
                400,
                f"input_file_id: no file with purpose 'batch' has id "
                f"{shorten(req.input_file_id)!r}",
                "input_file_id",
            )
        store = self.store
        batch = store.create_batch(source.id, req.endpoint, req.completion_window, req.metadata)
        self.jobs.enqueue(batch.id)
        return JSONResponse(batch.to_api())

    async def list_batches(self, after: str | None = None, limit: str = "20") -> Response:
        try:
            page, has_more = self.store.list_batches(after, _limit(limit, 100))
        except ValueError as e:
            raise APIError(400, str(e), "after") from None
        return _page([b.to_api() for b in page], has_more)

    async def get_batch(self, batch_id: str) -> Response:
        batch = self.store.get_batch(batch_id)
        if batch is None:
            raise _not_found("Batch", batch_id)
        return JSONResponse(batch.to_api())

    async def cancel_batch(self, batch_id: str) -> Response:
        batch = self.jobs.cancel(batch_id)
        if batch is None:
            raise _not_found("Batch", batch_id)
        return JSONResponse(batch.to_api())


def _limit(text: str, most: int) -> int:
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise APIError(400, f"limit must be an integer in [1, {most}]; got {text!r}", "limit")
    return int(text)


def _page(data: list[dict[str, Any]], has_more: bool) -> Response:
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def _not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind} object: {shorten(object_id)!r}", code="not_found")


def _file(store: BatchStore, file_id: str) -> Any:
    record = store.get_file(file_id)
    if record is None:
        raise _not_found("File", file_id)
    return record
