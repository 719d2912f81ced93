"""`fleetserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) of a fleet.

`--config fleet.yaml` names the models (serve/config/fleet_config.py); without it the flags
describe a fleet of one generate model. Lifecycle:
1. The fleet file is validated and every model's config and tokenizer load here; a bad
   file or --model fails before binding a port.
2. uvicorn binds; /live answers at once, /health and /ready are 503 while the engine
   processes load the weights. Once every model is ready, a curl line is printed.
3. SIGTERM/SIGINT drains: /health and /ready turn 503, new requests get 503, in-flight
   ones finish up to --drain-timeout (then they are aborted), the engine processes are
   shut down and the server exits 0. A second signal skips the wait.
4. If a model's last engine process dies, /health returns 503 and its requests get a
   503; the server keeps answering so an orchestrator can see it and replace it.
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

from fleetserve.batch.store import BatchStore, default_state_dir
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from
from fleetserve.entrypoints.openai.access_log import (
    ACCESS_LOG_MODES,
    AccessLogMiddleware,
    AccessRecord,
    configure_access_log,
    note_model,
    note_prompt_tokens,
)
from fleetserve.entrypoints.openai.admin import admin_router
from fleetserve.entrypoints.openai.batch_executor import FleetLineExecutor
from fleetserve.entrypoints.openai.body import ClientGone
from fleetserve.entrypoints.openai.dashboard import (
    DASHBOARD_ASSETS,
    DASHBOARD_SNAPSHOT,
    dashboard_router,
)
from fleetserve.entrypoints.openai.errors import APIError, error_body, error_response
from fleetserve.entrypoints.openai.http_protocol import FrontDoorH11Protocol
from fleetserve.entrypoints.openai.openapi import install_request_schemas
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.openai.protocol_embed import EmbeddingRequest, PredictRequest
from fleetserve.entrypoints.openai.replica_api import replica_router
from fleetserve.entrypoints.openai.serving_batch import batch_router
from fleetserve.entrypoints.openai.serving_chat import create_chat_completion
from fleetserve.entrypoints.openai.serving_common import (
    ServingContext,
    parse,
    read_body,
    unless_disconnected,
)
from fleetserve.entrypoints.openai.serving_completion import create_completion
from fleetserve.entrypoints.openai.serving_embedding import Embedder, create_embedding
from fleetserve.entrypoints.openai.serving_predict import Predictor
from fleetserve.entrypoints.openai.serving_predict import predict as run_predict
from fleetserve.metrics import CONTENT_TYPE, ServerMetrics
from fleetserve.serve.config.fleet_config import FleetConfig, load_fleet_config, single_model_fleet
from fleetserve.serve.telemetry.fleet_metrics import FleetCollector
from fleetserve.serve.routing.policies import POLICY_NAMES
from fleetserve.serve.services.service_registry import build_registry

# The dashboard's page and script hold no data (its snapshot API is behind the key).
_OPEN_PATHS = ("/health", "/ready", "/live", *DASHBOARD_ASSETS)
_CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads it


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--state-dir",
        default=None,
        help="where Batch API jobs and files live (SQLite + files; default: "
        "$FLEETSERVE_STATE_DIR, else ~/.local/state/fleetserve)",
    )
    g.add_argument(
        "--batch-concurrency",
        type=int,
        default=64,
        help="Batch API lines in flight at once (they queue in the `batch` class)",
    )
    g.add_argument(
        "--config",
        default=None,
        metavar="FLEET_YAML",
        help="serve the models of this fleet file (instead of --model and the engine flags)",
    )
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
    g.add_argument(
        "--access-log",
        default="json",
        choices=ACCESS_LOG_MODES,
        help="one JSON line per request on stdout (logger fleetserve.access; request id, "
        "model, class, replicas, status, tokens, timings), whatever --log-level says; off: none",
    )
    ray = p.add_argument_group("ray (pip install fleetserve[ray])")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="run the fleet as a Ray Serve application (one deployment per model)",
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="auto|HOST:PORT",
        help="the Ray cluster to join (with --ray); default: start a local one",
    )
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
    res = p.add_argument_group("resilience (a fleet file's `resilience:` per model)")
    res.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times a request may move to another replica when its replica is lost "
        "(died, drained, hung); 0: never (it fails with a clear error)",
    )
    res.add_argument(
        "--no-replace-failed",
        dest="replace_failed",
        action="store_false",
        help="do not start a new replica when one dies or hangs",
    )
    res.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        help="seconds a replica may hold work without an engine step before it is "
        "declared hung (its requests move; it is killed and replaced)",
    )
    res.add_argument(
        "--sigterm-grace",
        type=float,
        default=15.0,
        help="seconds an engine process keeps serving after SIGTERM while its requests "
        "move to other replicas",
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
    state: ServerState,
    drain_timeout: float,
    allowed_origins: Sequence[str] = (),
    batch_store: BatchStore | None = None,
    batch_concurrency: int = 64,
    request_id_header: bool = True,
) -> FastAPI:
    """The server's ASGI app; with `batch_store`, the OpenAI Batch and Files API too.
    `request_id_header=False` leaves X-Request-Id to a proxy in front (Ray Serve's)."""
    registry = state.ctx.registry

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
            await registry.shutdown()

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

    def unavailable() -> str | None:
        """Why the server cannot serve now (None: it can)."""
        if state.draining:
            return "the server is shutting down"
        if registry.dead_reason is not None:
            return registry.dead_reason
        if not registry.is_ready:
            return "loading: " + ", ".join(s.name for s in registry if not s.is_ready)
        return None

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 only when every model can take requests (vLLM's meaning: load balancers
        poll it before sending traffic); /live is liveness."""
        reason = unavailable()
        if reason is not None:
            return JSONResponse(error_body(503, reason), 503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/live", methods=["GET", "HEAD"])
    async def live() -> Response:
        """Liveness: restart the process only when this fails. It fails when a model is
        down for good: no replica serves and none is on its way (replacements failed, or
        --no-replace-failed); a fresh process is then the only way back. A model that
        lost replicas and is getting new ones is alive (and not ready)."""
        reason = registry.dead_reason if not state.draining else None
        if reason is not None:
            return JSONResponse(error_body(503, reason, code="dead"), 503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> Response:
        ok = unavailable() is None
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        # A model that cannot answer any more is not listed.
        cards = [c for c in registry.cards() if registry.services[c["id"]].dead_reason is None]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state.ctx, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await create_chat_completion(state.ctx, request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = parse(EmbeddingRequest, await read_body(state.ctx, request))
        service = state.ctx.model(body.model, "embed")
        assert isinstance(service, Embedder)
        note_model(request, service.name, "")
        out = await unless_disconnected(request, create_embedding(service, body))
        note_prompt_tokens(request, out["usage"]["prompt_tokens"])
        return JSONResponse(out)

    @app.post("/v1/models/{name}:predict")
    async def predict(name: str, request: Request) -> Response:
        body = parse(PredictRequest, await read_body(state.ctx, request))
        service = state.ctx.model(name, "custom")
        assert isinstance(service, Predictor)
        note_model(request, service.name, "")
        return JSONResponse(await unless_disconnected(request, run_predict(service, body)))

    if batch_store is not None:
        # The Batch API's worker starts with the app (it resumes unfinished batches) and
        # runs each line through the registry, in the model's `batch` class if it has one.
        app.include_router(
            batch_router(
                batch_store,
                lambda: FleetLineExecutor(state.ctx),
                concurrency=batch_concurrency,
                max_body_bytes=state.ctx.max_body_bytes,
                read_timeout_s=state.ctx.read_timeout_s,
            )
        )
    app.include_router(admin_router(state.ctx, key_required=state.api_key is not None))
    app.include_router(replica_router(state.ctx))
    app.include_router(dashboard_router(state.metrics, registry))
    install_request_schemas(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/embeddings": EmbeddingRequest,
            "/v1/models/{name}:predict": PredictRequest,
        },
    )
    guarded: Any = GuardMiddleware(app, state)
    if allowed_origins:
        # Outside the guard, so that preflights (which carry no credentials) are answered.
        guarded = CORSMiddleware(
            guarded,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Fleetserve-Class", "X-Request-Id"],
            expose_headers=["X-Request-Id"],
        )

    def count(record: AccessRecord, status: int) -> None:
        if record.model is not None:
            # A handler noted the model, so a route matched (never the raw path: unbounded).
            route = record.route or ""
            state.metrics.count_response(record.model, record.class_name or "", route, status)

    # Outermost, so that every answer (a 401, a CORS preflight) has an id and a log line.
    quiet = (*_OPEN_PATHS, "/metrics", DASHBOARD_SNAPSHOT)
    outer: Any = AccessLogMiddleware(
        guarded, on_done=count, quiet_paths=quiet, add_header=request_id_header
    )
    return outer  # type: ignore[no-any-return]


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
        draining_paths = ("/v1/", "/internal/v1/")
        if st.draining and scope["path"].startswith(draining_paths) and scope["method"] == "POST":
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
    try:
        await state.ctx.registry.start()
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
    first = next(iter(state.ctx.registry)).name
    body = {
        "model": first,
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 32,
    }
    auth = ' -H "Authorization: Bearer $FLEETSERVE_API_KEY"' if state.api_key else ""
    print(
        f"fleetserve: ready on http://{host}:{port} "
        f"({', '.join(s.name for s in state.ctx.registry)}). Try:\n"
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
                self.state.ctx.registry.abort_all("the server is shutting down")
            return
        self.state.draining = True
        self.state.ctx.draining = True
        self.state.ctx.drain_deadline = time.monotonic() + self.drain_timeout
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        registry = self.state.ctx.registry
        while self.state.num_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.num_in_flight > 0:
            registry.abort_all("the server is shutting down (drain timeout)")
            for _ in range(40):
                if self.state.num_in_flight == 0:
                    break
                await asyncio.sleep(0.05)
        self.should_exit = True


# Flags that describe the one model of a flagless fleet; with --config the file does.
_MODEL_FLAGS = (
    "served_model_name", "max_waiting_requests", "data_parallel_size", "routing", "model",
    "dtype", "max_model_len", "block_size", "num_kv_blocks", "kv_cache_memory",
    "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching", "scheduling_policy",
    "seed", "device", "num_threads", "attention_backend", "tensor_parallel_size",
    "pipeline_parallel_size", "migration_limit", "replace_failed", "hang_timeout",
    "sigterm_grace",
)  # fmt: skip


def fleet_from_args(args: argparse.Namespace) -> FleetConfig:
    """The fleet file, or the flags' fleet of one model. With --config a model flag is an
    error (it would be ignored)."""
    if args.config is not None:
        parser = argparse.ArgumentParser()
        add_cli_args(parser)
        defaults = vars(parser.parse_args([]))
        given = [f for f in _MODEL_FLAGS if getattr(args, f) != defaults[f]]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ValueError(f"--config describes every model; leave out {flags}")
        return load_fleet_config(args.config)
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    engine_args = engine_args_from(args)
    name = served_name(engine_args, args.served_model_name)
    resilience = {
        "migration_limit": args.migration_limit,
        "replace_failed": args.replace_failed,
        "hang_timeout_s": args.hang_timeout,
        "sigterm_grace_s": args.sigterm_grace,
    }
    return single_model_fleet(
        name,
        engine_args,
        args.data_parallel_size,
        args.routing,
        args.max_waiting_requests,
        resilience,
    )


def served_name(engine_args: EngineArgs, given: str | None) -> str:
    """The name clients send for a model given by flags: --served-model-name, else the
    checkpoint's file or folder name (the default model's when none is named)."""
    if given is not None:
        return given
    path = engine_args.model
    if path is None:
        from fleetserve.models.default_model import default_model_path

        try:
            path = default_model_path()
        except OSError as e:
            raise ValueError(str(e)) from e
    return default_served_name(path)


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
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not args.request_read_timeout > 0:
        raise ValueError(f"--request-read-timeout must be > 0, got {args.request_read_timeout}")
    api_key = api_key_from(args.api_key, os.environ)
    fleet = fleet_from_args(args)
    if args.ray:
        from fleetserve.ray.serve_cli import run_on_ray

        return run_on_ray(args, fleet, api_key)
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --ray")
    ray_only = fleet.ray_only_keys()
    if ray_only:
        raise ValueError(f"{', '.join(ray_only)}: only `fleetserve serve --ray` honours these")
    metrics = ServerMetrics()
    registry = build_registry(fleet, metrics)
    metrics.registry.register(FleetCollector(list(registry)))
    ctx = ServingContext(registry, args.max_request_bytes, args.request_read_timeout)
    state = ServerState(ctx, metrics, api_key)
    if args.batch_concurrency < 1:
        raise ValueError(f"--batch-concurrency must be >= 1, got {args.batch_concurrency}")
    store = BatchStore(args.state_dir or default_state_dir())
    app = build_app(state, args.drain_timeout, args.allowed_origins, store, args.batch_concurrency)
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
    configure_access_log(args.access_log)
    server = DrainingServer(config, state)
    state.server = server
    server.run()
    if registry.crashed and state.exit_code == 0:
        state.exit_code = 1  # the engine process crashed or was killed
    return state.exit_code
