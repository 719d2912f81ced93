"""A real uvicorn server that mounts `batch_router` over a real one-model fleet (test helper).

    python tests/server/batch_server.py --model DIR --state-dir DIR --port N [--concurrency K]

It mounts the router the way `fleetserve serve` does (include_router, the app's APIError
handler, the registry started in the app's lifespan), with a small file limit and a
concurrency the tests choose; test_server_batch.py also checks `fleetserve serve` itself.
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
from fleetserve.entrypoints.openai.batch_executor import FleetLineExecutor
from fleetserve.entrypoints.openai.errors import APIError, error_response
from fleetserve.entrypoints.openai.serving_batch import batch_router
from fleetserve.entrypoints.openai.serving_common import ServingContext
from fleetserve.metrics import ServerMetrics
from fleetserve.serve.config.fleet_config import single_model_fleet
from fleetserve.serve.services.service_registry import build_registry


def build(args: argparse.Namespace) -> FastAPI:
    engine_args = EngineArgs(model=args.model, max_num_seqs=args.max_num_seqs)
    fleet = single_model_fleet("tiny", engine_args, 1, "least_loaded", 256)
    registry = build_registry(fleet, ServerMetrics())
    server = ServingContext(registry, max_body_bytes=1 << 20)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(registry.start())
        try:
            yield
        finally:
            loader.cancel()
            await registry.shutdown()

    app = FastAPI(lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.get("/ready")
    async def ready() -> Response:
        return JSONResponse({"ready": registry.is_ready}, 200 if registry.is_ready else 503)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        from fleetserve.entrypoints.openai.serving_chat import create_chat_completion

        return await create_chat_completion(server, request)

    store = BatchStore(args.state_dir)
    app.include_router(
        batch_router(
            store,
            lambda: FleetLineExecutor(server),
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
