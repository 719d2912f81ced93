"""`fleetserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Lifecycle:
1. The model's config and tokenizer load here; a bad --model fails before binding a port.
2. uvicorn binds; /health answers at once, /ready is false while the EngineCore process
   loads the weights. Once it is ready, a curl line is printed.
3. SIGTERM/SIGINT drains: /ready turns false, new requests get 503, in-flight ones
   finish up to --drain-timeout (then they are aborted), the engine process is shut down
   and the server exits 0. A second signal skips the wait.
4. If the engine process dies, /health returns 503 and every request gets a 503; the
   server keeps answering so an orchestrator can see it and replace it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import AsyncEngine
from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from
from fleetserve.entrypoints.openai.body import ClientGone
from fleetserve.entrypoints.openai.errors import APIError, error_body, error_response
from fleetserve.entrypoints.openai.http_protocol import FrontDoorH11Protocol
from fleetserve.entrypoints.openai.openapi import install_request_schemas
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.openai.serving_chat import create_chat_completion
from fleetserve.entrypoints.openai.serving_common import ServingContext
from fleetserve.entrypoints.openai.serving_completion import create_completion
from fleetserve.metrics import CONTENT_TYPE, ServerMetrics
from fleetserve.serve.policies import POLICY_NAMES

_OPEN_PATHS = ("/health", "/ready", "/live")
_CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads it


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name clients send")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $FLEETSERVE_API_KEY)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests queued before the first token; beyond it, 503",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take after SIGTERM",
    )
    g.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024)
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=15.0,
        help="seconds a client may take to send a request's headers, and then its body",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        metavar="ORIGIN",
        help="web origins (https://app.example) whose pages may call the API (CORS); default: none",
    )
    g.add_argument("--log-level", default="info")
    dp = p.add_argument_group("data parallel")
    dp.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas (each its own engine process, TP x PP ranks) behind this API",
    )
    dp.add_argument(
        "--routing",
        default="least_loaded",
        choices=POLICY_NAMES,
        help="how requests are spread over the replicas (with --data-parallel-size > 1)",
    )
    add_engine_args(p)


def default_served_name(model_path: str) -> str:
    name = os.path.basename(model_path.rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


class ServerState:
    def __init__(self, ctx: ServingContext, metrics: ServerMetrics, api_key: str | None):
        self.ctx = ctx
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.num_in_flight = 0
        self.draining = False
        self.exit_code = 0
        self.server: DrainingServer | None = None


def build_app(
    state: ServerState, drain_timeout: float, allowed_origins: Sequence[str] = ()
) -> FastAPI:
    engine = state.ctx.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load_engine(state))
        if state.server is not None:
            state.server.loop = asyncio.get_running_loop()
            state.server.drain_timeout = drain_timeout
        try:
            yield
        finally:
            loader.cancel()
            await engine.shutdown()

    app = FastAPI(title="fleetserve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=_CLIENT_CLOSED)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(error_body(400, str(exc)), 400)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.dead_reason is not None and not state.draining:
            return JSONResponse(error_body(503, engine.dead_reason), 503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/live", methods=["GET", "HEAD"])
    async def live() -> Response:
        """Liveness: the process answers. Restart it only when this fails."""
        return JSONResponse({"status": "ok"})

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> Response:
        ok = engine.is_ready and not state.draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        if engine.dead_reason is not None:  # a model that cannot answer is not listed
            return JSONResponse({"object": "list", "data": []})
        card = {
            "id": state.ctx.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "fleetserve",
            "root": engine.config.model_path,
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state.ctx, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await create_chat_completion(state.ctx, request)

    install_request_schemas(
        app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    )
    guarded: Any = GuardMiddleware(app, state)
    if allowed_origins:
        # Outside the guard, so that preflights (which carry no credentials) are answered.
        guarded = CORSMiddleware(
            guarded,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Fleetserve-Class"],
        )
    return guarded  # type: ignore[no-any-return]


class GuardMiddleware:
    """Auth, drain refusal and in-flight counting, at the ASGI level so that a streaming
    response counts as in flight until its last byte."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        st = self.state
        if st.api_key is not None and not self._authorized(scope):
            err = APIError(401, "missing or invalid API key (Authorization: Bearer KEY)")
            err.headers = {"WWW-Authenticate": "Bearer"}
            await error_response(err)(scope, receive, send)
            return
        if st.draining and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            err = APIError(503, "the server is shutting down", code="draining")
            await error_response(err)(scope, receive, send)
            return
        st.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            st.num_in_flight -= 1

    def _authorized(self, scope: Any) -> bool:
        assert self.state.api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(token.strip(), self.state.api_key)
        return False


async def _load_engine(state: ServerState) -> None:
    engine = state.ctx.engine
    try:
        await engine.start()
    except Exception as e:
        print(f"fleetserve: error: {e}", file=sys.stderr, flush=True)
        state.exit_code = 1
        if state.server is not None:
            state.server.should_exit = True
        return
    server = state.server
    while server is not None and not server.started:
        await asyncio.sleep(0.05)
    _print_ready(state)


def _print_ready(state: ServerState) -> None:
    server = state.server
    host, port = ("127.0.0.1", 8000)
    if server is not None:
        host, port = server.config.host, server.config.port
        if server.servers and server.servers[0].sockets:
            port = server.servers[0].sockets[0].getsockname()[1]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    body = {
        "model": state.ctx.served_model_name,
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 32,
    }
    auth = ' -H "Authorization: Bearer $FLEETSERVE_API_KEY"' if state.api_key else ""
    print(
        f"fleetserve: ready on http://{host}:{port} ({state.ctx.served_model_name}). Try:\n"
        f"  curl http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json'"
        f"{auth} -d {shlex.quote(json.dumps(body))}",
        flush=True,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains before exiting instead of stopping."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_timeout = 30.0
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not recorded as captured: uvicorn would re-raise it after serve() and the process
        # would die by the signal instead of exiting 0 after a clean drain.
        if self.loop is None or self.state.draining:
            self.should_exit = True
            if self.state.draining:
                self.force_exit = sig == signal.SIGINT
                self.state.ctx.engine.abort_all("the server is shutting down")
            return
        self.state.draining = True
        self.state.ctx.draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        engine = self.state.ctx.engine
        while self.state.num_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.num_in_flight > 0:
            engine.abort_all("the server is shutting down (drain timeout)")
            for _ in range(40):
                if self.state.num_in_flight == 0:
                    break
                await asyncio.sleep(0.05)
        self.should_exit = True


def _make_engine(engine_args: EngineArgs, args: argparse.Namespace) -> Any:
    """A plain AsyncEngine, or K of them behind a router (same surface to the handlers)."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size == 1:
        return AsyncEngine(engine_args, args.max_waiting_requests)
    from fleetserve.serve.dp_engine import DataParallelEngine

    return DataParallelEngine(
        engine_args, args.data_parallel_size, args.routing, args.max_waiting_requests
    )


def api_key_from(flag: str | None, env: Mapping[str, str]) -> str | None:
    """The key from --api-key, else $FLEETSERVE_API_KEY, else None (no auth). An empty key
    or one with surrounding spaces is refused: the first would turn auth off without a
    word, the second could never match (clients strip the header value)."""
    source, key = ("--api-key", flag) if flag is not None else ("FLEETSERVE_API_KEY", None)
    if flag is None:
        key = env.get("FLEETSERVE_API_KEY")
    if key is None:
        return None
    if key == "":
        raise ValueError(f"{source} is empty; give a key, or leave it out to serve without auth")
    if key != key.strip():
        raise ValueError(f"{source} has leading or trailing whitespace, so it could never match")
    if not key.isprintable() or not key.isascii():
        raise ValueError(f"{source} must be printable ASCII (it travels in an HTTP header)")
    return key


def run(args: argparse.Namespace) -> int:
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not args.request_read_timeout > 0:
        raise ValueError(f"--request-read-timeout must be > 0, got {args.request_read_timeout}")
    api_key = api_key_from(args.api_key, os.environ)
    engine_args = engine_args_from(args)
    try:
        engine = _make_engine(engine_args, args)
    except OSError as e:  # a missing checkpoint or default model: a user error, no traceback
        raise ValueError(str(e)) from e
    name = args.served_model_name or default_served_name(engine.config.model_path)
    metrics = ServerMetrics(name)
    engine.metrics = metrics
    ctx = ServingContext(engine, name, args.max_request_bytes, args.request_read_timeout)
    state = ServerState(ctx, metrics, api_key)
    app = build_app(state, args.drain_timeout, args.allowed_origins)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=FrontDoorH11Protocol.with_header_timeout(args.request_read_timeout),
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
        access_log=args.log_level == "debug",
    )
    server = DrainingServer(config, state)
    state.server = server
    server.run()
    if engine.crashed and state.exit_code == 0:
        state.exit_code = 1  # the engine process crashed or was killed
    return state.exit_code
