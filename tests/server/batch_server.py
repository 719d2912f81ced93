"""A real uvicorn server that mounts `batch_router` over a real AsyncEngine (test helper).

    python tests/server/batch_server.py --model DIR --state-dir DIR --port N [--concurrency K]

It mounts the router the way `fleetserve serve` will (include_router, the app's APIError
handler, the engine started in the app's lifespan), until the lead wires it there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fleetserve.batch.store import BatchStore
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import AsyncEngine
from fleetserve.entrypoints.openai.batch_executor import EngineLineExecutor
from fleetserve.entrypoints.openai.errors import APIError, error_response
from fleetserve.entrypoints.openai.serving_batch import batch_router
from fleetserve.entrypoints.openai.serving_common import ServingContext


def build(args: argparse.Namespace) -> FastAPI:
    engine = AsyncEngine(EngineArgs(model=args.model, max_num_seqs=args.max_num_seqs))
    ctx = ServingContext(engine, "tiny", max_body_bytes=1 << 20)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(engine.start())
        try:
            yield
        finally:
            loader.cancel()
            await engine.shutdown()

    app = FastAPI(lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.get("/ready")
    async def ready() -> Response:
        return JSONResponse({"ready": engine.is_ready}, 200 if engine.is_ready else 503)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        from fleetserve.entrypoints.openai.serving_chat import create_chat_completion

        return await create_chat_completion(ctx, request)

    store = BatchStore(args.state_dir)
    app.include_router(
        batch_router(
            store,
            lambda: EngineLineExecutor(ctx),
            concurrency=args.concurrency,
            max_file_bytes=args.max_file_bytes,
        )
    )
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-file-bytes", type=int, default=1 << 20)
    args = p.parse_args()
    uvicorn.run(build(args), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
