"""The OpenAI server's ASGI app (`build_app`), for the local server (api_server.py) and
the Ray ingress (ray/ingress.py) alike: error handlers, the health and model-list routes,
the OpenAI routes, the Batch/Files API (serving_batch.py), the admin, replica and
dashboard routers, then the guard (auth, drain refusal, in-flight count), CORS and the
access log around it. Each group of routes is added by its own function below.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import shlex
import sys
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from fleetserve.batch.store import BatchStore
from fleetserve.entrypoints.openai.access_log import (
    AccessLogMiddleware,
    AccessRecord,
    access_record,
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
from fleetserve.entrypoints.openai.fleet_client import bind_fleet_clients
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
    service_class,
    unless_disconnected,
)
from fleetserve.entrypoints.openai.serving_completion import create_completion
from fleetserve.entrypoints.openai.serving_embedding import Embedder, create_embedding
from fleetserve.entrypoints.openai.serving_lora import lora_router
from fleetserve.entrypoints.openai.serving_predict import Predictor
from fleetserve.entrypoints.openai.serving_predict import predict as run_predict
from fleetserve.metrics import CONTENT_TYPE, ServerMetrics

if TYPE_CHECKING:
    from fleetserve.entrypoints.openai.draining_server import DrainingServer

# The dashboard's page and script hold no data (its snapshot API is behind the key).
_OPEN_PATHS = ("/health", "/ready", "/live", *DASHBOARD_ASSETS)
_CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads it


class ServerState:
    def __init__(self, ctx: ServingContext, metrics: ServerMetrics, api_key: str | None):
        self.ctx = ctx
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.num_in_flight = 0
        self.draining = False
        self.exit_code = 0
        self.server: DrainingServer | None = None  # the local server's; None on Ray


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
    app = FastAPI(
        title="fleetserve",
        lifespan=_lifespan(state, drain_timeout),
        docs_url=None,
        redoc_url=None,
    )
    _add_error_handlers(app)
    _add_health_routes(app, state)
    _add_model_routes(app, state)
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
    app.include_router(lora_router(state.ctx, key_required=state.api_key is not None))
    app.include_router(replica_router(state.ctx))
    app.include_router(dashboard_router(state.metrics, state.ctx.registry))
    install_request_schemas(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/embeddings": EmbeddingRequest,
            "/v1/models/{name}:predict": PredictRequest,
        },
    )
    return _wrap(app, state, allowed_origins, request_id_header)  # type: ignore[return-value]


def _lifespan(state: ServerState, drain_timeout: float) -> Any:
    """Starts the registry's models with the app; shuts them down with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load_engine(state))
        bind_fleet_clients(state.ctx.registry, asyncio.get_running_loop())  # handlers' sub-calls
        if state.server is not None:
            state.server.loop = asyncio.get_running_loop()
            state.server.drain_timeout = drain_timeout
        try:
            yield
        finally:
            loader.cancel()
            await state.ctx.registry.shutdown()

    return lifespan


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=_CLIENT_CLOSED)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code)


async def _validation_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body(400, str(exc)), 400)


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


def unavailable(state: ServerState) -> str | None:
    """Why the server cannot serve now (None: it can)."""
    registry = state.ctx.registry
    if state.draining:
        return "the server is shutting down"
    if registry.dead_reason is not None:
        return registry.dead_reason
    unhealthy = [
        f"model {s.name!r} is unhealthy: {why}"
        for s in registry
        if (why := getattr(s, "unhealthy_reason", None)) is not None
    ]
    if unhealthy:  # a custom model's handler stuck in a call, or restarting
        return "; ".join(unhealthy)
    if not registry.is_ready:
        return "loading: " + ", ".join(s.name for s in registry if not s.is_ready)
    return None


def _add_health_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /live, /ready and /metrics."""

    async def health() -> Response:
        """200 only when every model can take requests (vLLM's meaning: load balancers
        poll it before sending traffic); /live is liveness."""
        reason = unavailable(state)
        if reason is not None:
            return JSONResponse(error_body(503, reason), 503)
        return JSONResponse({"status": "ok"})

    async def live() -> Response:
        """Liveness: restart the process only when this fails. It fails when a model is
        down for good: no replica serves and none is on its way (replacements failed, or
        --no-replace-failed); a fresh process is then the only way back. A model that
        lost replicas and is getting new ones is alive (and not ready)."""
        reason = state.ctx.registry.dead_reason if not state.draining else None
        if reason is not None:
            return JSONResponse(error_body(503, reason, code="dead"), 503)
        return JSONResponse({"status": "ok"})

    async def ready() -> Response:
        ok = unavailable(state) is None
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    for path, probe in (("/health", health), ("/live", live), ("/ready", ready)):
        app.add_api_route(path, probe, methods=["GET"])
        # HEAD answers too, but is not published: one route of two methods would give
        # /openapi.json the same operationId twice.
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"])


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    """The OpenAI routes: models, completions, chat, embeddings, and custom predict."""
    ctx = state.ctx

    async def models() -> Response:
        # A model that cannot answer any more is not listed.
        registry = ctx.registry
        cards = []
        for card in registry.cards():
            # An adapter's card names its base model as its parent.
            owner = registry.services[card.get("parent", card["id"])]
            if owner.dead_reason is None:
                cards.append(card)
        return JSONResponse({"object": "list", "data": cards})

    async def model_card(name: str) -> Response:
        # client.models.retrieve(name): the card /v1/models lists, or 404.
        registry = ctx.registry
        for card in registry.cards():
            if card["id"] == name and registry.services[name].dead_reason is None:
                return JSONResponse(card)
        raise APIError(404, f"the model {name!r} does not exist", "model", "model_not_found")

    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    async def chat(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    async def embeddings(request: Request) -> Response:
        body = parse(EmbeddingRequest, await read_body(ctx, request))
        service = ctx.model(body.model, "embed")
        assert isinstance(service, Embedder)
        note_model(request, service.name, "")
        out = await unless_disconnected(request, create_embedding(service, body))
        note_prompt_tokens(request, out["usage"]["prompt_tokens"])
        return JSONResponse(out)

    async def predict(name: str, request: Request) -> Response:
        raw = await read_body(ctx, request)
        if (graph := ctx.graph(name)) is not None:  # serve/pipelines/graph_*.py
            from fleetserve.entrypoints.openai.serving_graph import graph_predict

            return await graph_predict(request, ctx.registry, graph, raw)
        body = parse(PredictRequest, raw)
        service = ctx.model(name, "custom")
        assert isinstance(service, Predictor)
        class_name = service_class(request, None)  # its handler's sub-calls take it
        note_model(request, service.name, "")
        record = access_record(request)  # the sub-calls go on its line
        sub_calls = record.sub_calls if record is not None else None
        work = run_predict(service, body, class_name, sub_calls)
        return JSONResponse(await unless_disconnected(request, work))

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", model_card, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/v1/models/{name}:predict", predict, methods=["POST"])


def _wrap(
    app: FastAPI, state: ServerState, allowed_origins: Sequence[str], request_id_header: bool
) -> Any:
    """The guard around the app, CORS around that, and the access log outermost."""
    guarded: Any = GuardMiddleware(app, state)
    if allowed_origins:
        # Outside the guard, so that preflights (which carry no credentials) are answered.
        guarded = CORSMiddleware(
            guarded,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=[
                "Authorization",
                "Content-Type",
                "X-Fleetserve-Class",
                "X-Fleetserve-Deadline-Ms",
                "X-Request-Id",
            ],
            expose_headers=["X-Request-Id"],
        )

    def count(record: AccessRecord, status: int) -> None:
        if record.model is not None:
            # A handler noted the model, so a route matched (never the raw path: unbounded).
            route = record.route or ""
            state.metrics.count_response(record.model, record.class_name or "", route, status)

    # Outermost, so that every answer (a 401, a CORS preflight) has an id and a log line.
    quiet = (*_OPEN_PATHS, "/metrics", DASHBOARD_SNAPSHOT)
    return AccessLogMiddleware(
        guarded, on_done=count, quiet_paths=quiet, add_header=request_id_header
    )


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
