"""Requests to a graph (serve/pipelines/graph_service.py) over HTTP.

POST /v1/models/{name}:predict runs the whole graph on the JSON body and answers the last
step's body (or the ensemble's merge) with a `fleetserve` field: {"graph", "steps": [{"step",
"model" | "node", "ms"}]}. When the graph's answer is a generate model's, /v1/chat/completions
and /v1/completions serve it too: the steps before the last run through the fleet client,
and the last one is admitted to its model like any request to that model (its class and
priority; streamed with the real SSE chunks, the `fleetserve` field in the first one).
Each step goes through its model's own service with the request's class; the graph's
`timeout_s` bounds the steps before the answer (504 past it).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetserve.entrypoints.openai.access_log import note_model
from fleetserve.entrypoints.openai.deadline import (
    deadline_time,
    exceeded,
    remaining_s,
    with_deadline,
)
from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.fleet_client import FleetCallError, GatewayFleetClient
from fleetserve.entrypoints.openai.serving_common import (
    ModelContext,
    SSEResponse,
    admit,
    collect,
    new_id,
    parse,
    service_class,
    sse,
    unless_disconnected,
)
from fleetserve.outputs import RequestOutput
from fleetserve.serve.pipelines.graph_executor import GraphError, Trace
from fleetserve.serve.pipelines.graph_service import GraphService
from fleetserve.serve.request_state import FleetStream
from fleetserve.serve.services.service_registry import Registry

GRAPH_HEADER = "X-Fleetserve-Graph-Steps"


async def _run(
    request: Request,
    registry: Registry,
    graph: GraphService,
    body: dict[str, Any],
    class_name: str | None,
    defer_last: bool,
) -> tuple[Any, Trace]:
    client = GatewayFleetClient(registry, class_name, deadline_time(request))
    work = graph.run(client, body, defer_last)
    try:
        return await unless_disconnected(request, asyncio.wait_for(work, graph.plan.timeout_s))
    except TimeoutError:
        left = remaining_s(request)
        if left is not None and left <= 0:  # both passed (a stalled loop): the tighter one
            raise exceeded(request, f"the graph {graph.name!r}") from None
        raise APIError(504, f"the graph {graph.name!r} ran past its timeout_s "
                       f"({graph.plan.timeout_s:g} s)") from None  # fmt: skip
    except FleetCallError as e:
        left = remaining_s(request)
        if e.past_deadline or (e.status == 504 and left is not None and left <= 0):
            raise exceeded(request, f"the graph {graph.name!r}") from None
        raise APIError(e.status, f"graph {graph.name!r}: {e}") from None
    except GraphError as e:
        raise APIError(e.status, str(e)) from None


def _answered(info: dict[str, Any], start: float) -> None:
    """The last step's time, once its answer is whole (the trace's last entry)."""
    info["steps"][-1]["ms"] = round((time.monotonic() - start) * 1e3, 3)


def _info(graph: GraphService, trace: Trace) -> dict[str, Any]:
    return {"graph": graph.name, "steps": trace.steps}


async def graph_predict(
    request: Request, registry: Registry, graph: GraphService, body: dict[str, Any]
) -> Response:
    """The predict route on a graph: the whole graph, its answer as a JSON body."""
    class_name = service_class(request, None)
    note_model(request, graph.name, "")
    out, trace = await _run(request, registry, graph, body, class_name, False)
    if isinstance(out, dict):
        return JSONResponse({**out, "fleetserve": _info(graph, trace)})
    return JSONResponse({"predictions": out, "fleetserve": _info(graph, trace)})


async def graph_generate(
    request: Request, registry: Registry, graph: GraphService, raw: dict[str, Any], chat: bool
) -> Response:
    """/v1/chat/completions (`chat`) or /v1/completions on a graph whose answer is a
    generate model's: the steps before the last, then the last one admitted and answered
    (or streamed) as that endpoint answers."""
    if not graph.answers_generate:
        raise APIError(400, f"the graph {graph.name!r} does not end in a generate model; "
                       f"call POST /v1/models/{graph.name}:predict", "model")  # fmt: skip
    class_name = service_class(request, raw.get("service_tier"))
    note_model(request, graph.name, class_name)
    _, trace = await _run(request, registry, graph, raw, class_name, True)
    call = trace.deferred
    assert call is not None  # answers_generate: the last step is a generate model's
    form = "messages" if chat else "prompt"
    if form not in call.body:
        other = "/v1/completions" if chat else "/v1/chat/completions"
        raise APIError(400, f"the graph {graph.name!r}'s last step ({call.step!r}) takes "
                       f"{'a prompt' if chat else 'messages'}; call {other}")  # fmt: skip
    service = registry.services[call.model]
    ctx = ModelContext(service, graph.name, getattr(service, "tool_parser", None))  # type: ignore[arg-type]
    body = {**call.body, "model": call.model}
    for key in ("stream", "stream_options"):
        if key in raw:
            body[key] = raw[key]
    info = _info(graph, trace)
    writer = _chat_writer() if chat else _completion_writer()

    def done(outcome: str, seconds: float | None) -> None:
        graph.observe_deferred(call.step, outcome, seconds)

    return await _answer(request, ctx, body, class_name, info, writer, done)


@dataclass(frozen=True)
class _Writer:
    """How one endpoint turns a body into its answer (serving_chat / serving_completion)."""

    model: type[Any]  # the request's protocol model
    prefix: str  # of the response id
    inputs: Callable[[ModelContext, Any], Awaitable[tuple[list[Any], Any]]]
    body: Callable[[ModelContext, Any, str, list[RequestOutput]], dict[str, Any]]
    stream: Callable[[ModelContext, Any, str, list[FleetStream]], AsyncIterator[str]]


def _chat_writer() -> _Writer:
    from fleetserve.cpu_work import run_cpu
    from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest
    from fleetserve.entrypoints.openai.serving_chat import (
        _stream,
        chat_completion_body,
        chat_inputs,
    )

    async def inputs(ctx: ModelContext, req: Any) -> tuple[list[Any], Any]:
        prompt, base = await run_cpu(chat_inputs, ctx, req)
        return [prompt], base

    def body(ctx: ModelContext, req: Any, rid: str, finals: list[RequestOutput]) -> Any:
        return chat_completion_body(ctx, req, rid, finals[0])

    return _Writer(ChatCompletionRequest, "chatcmpl", inputs, body, _stream)


def _completion_writer() -> _Writer:
    from fleetserve.entrypoints.openai.protocol import CompletionRequest
    from fleetserve.entrypoints.openai.serving_common import tokenize_large
    from fleetserve.entrypoints.openai.serving_completion import (
        _stream,
        completion_body,
        completion_inputs,
    )

    async def inputs(ctx: ModelContext, req: Any) -> tuple[list[Any], Any]:
        prompts, base = completion_inputs(req)
        return await tokenize_large(ctx, prompts), base

    return _Writer(CompletionRequest, "cmpl", inputs, completion_body, _stream)


async def _answer(
    request: Request, ctx: ModelContext, raw: dict[str, Any], class_name: str | None,
    info: dict[str, Any], writer: _Writer, done: Callable[[str, float | None], None],
) -> Response:  # fmt: skip
    """The last step, admitted to its model and answered (or streamed) as `writer`'s
    endpoint answers, with the `fleetserve` field; `done(outcome, seconds)` once it ends."""
    start = time.monotonic()
    try:
        req = parse(writer.model, raw)
        prompts, base = await writer.inputs(ctx, req)
        request_id = new_id(writer.prefix)
        streams = await admit(
            request, ctx, request_id, prompts, lambda: copy.copy(base), req.priority, class_name
        )
        if req.stream:
            chunks = _timed(writer.stream(ctx, req, request_id, streams), info, start, done)
            return SSEResponse(with_deadline(request, chunks))
        finals = await unless_disconnected(request, collect(streams))
    except asyncio.CancelledError:
        done("cancelled", None)
        raise
    except Exception:
        done("error", None)
        raise
    _answered(info, start)
    done("ok", time.monotonic() - start)
    return JSONResponse({**writer.body(ctx, req, request_id, finals), "fleetserve": info})


def _with_field(chunk: str, info: dict[str, Any]) -> str:
    body = json.loads(chunk[len("data: ") :])
    body["fleetserve"] = info
    return sse(body)


async def _timed(
    chunks: AsyncIterator[str], info: dict[str, Any], start: float,
    done: Callable[[str, float | None], None],
) -> AsyncIterator[str]:  # fmt: skip
    """The last step's stream with the `fleetserve` field in its first chunk and, with the
    last step's time, in its last one: once a choice has finished, each chunk is held until
    the next comes, so the one before [DONE] can carry it (no chunk before is delayed)."""
    first, ending = True, False
    held: str | None = None
    outcome, seconds = "cancelled", None
    try:
        async for s in chunks:
            if not s.startswith("data: {"):  # [DONE]: the held chunk was the last one
                if held is not None:
                    _answered(info, start)
                    yield _with_field(held, info)
                    held = None
                yield s
                continue
            if first:
                first = False
                s = _with_field(s, info)
            if held is not None:
                yield held
                held = None
            ending = ending or '"finish_reason":"' in s
            if ending:
                held = s
            else:
                yield s
        if held is not None:
            _answered(info, start)
            yield _with_field(held, info)
        outcome, seconds = "ok", time.monotonic() - start
    except Exception:
        outcome = "error"
        raise
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
        done(outcome, seconds)
