"""The replica API: how a gateway (serve/remote/replica.py) uses this server as one of its
replicas. Same auth as /v1 (the GuardMiddleware); refused with 503 `draining` once the
server is shutting down. Schema: serve/remote/wire.py.

    POST /internal/v1/replica/generate  GenerateRequest (application/msgpack or JSON)
         -> 200 application/x-fleetserve-frames: the request's outputs as delta frames,
            or 4xx / 503 with the OpenAI error body before the first frame
    GET  /internal/v1/replica/load?model=NAME -> LoadReport (JSON)

The work is admitted into this server's own GenerateService (its class queue, replicas
and migration apply); its class is the one of the same priority as the gateway's class
(gateway and pods serve one fleet file), else the default class. A gateway that closes
the stream aborts the request here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from fleetserve.engine.stats import EngineStats
from fleetserve.entrypoints.openai.body import ClientGone, read_bytes
from fleetserve.entrypoints.openai.errors import APIError, from_value_error
from fleetserve.entrypoints.openai.serving_common import (
    ServingContext,
    SSEResponse,
    engine_error,
    unless_disconnected,
)
from fleetserve.serve.admission.sla import split_engine_priority
from fleetserve.serve.remote.wire import (
    FRAMES,
    GENERATE_PATH,
    LOAD_PATH,
    MSGPACK,
    ErrorFrame,
    FrameWriter,
    GenerateRequest,
    LoadReport,
    check_resume,
    params_from_http,
)
from fleetserve.serve.request_state import FleetStream
from fleetserve.serve.services.generate import GenerateService


def replica_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    def service_for(name: str | None) -> GenerateService:
        service = ctx.model(name, "generate")  # 404 unknown, 400 another kind
        if not isinstance(service, GenerateService):
            raise APIError(400, f"the model {service.name!r} has no replicas here", "model")
        return service

    @router.post(GENERATE_PATH)
    async def generate(request: Request) -> Response:
        req = decode_request(request, await read_bytes(request, ctx.max_body_bytes,
                                                       ctx.read_timeout_s))  # fmt: skip
        service = service_for(req.model)
        try:
            params = params_from_http(req.params)
            if req.resume is not None:
                vocab = service.config.model.vocab_size
                check_resume(req.resume, req.prompt_token_ids, params, vocab)
        except ValueError as e:
            raise from_value_error(e) from None
        level, priority = split_engine_priority(req.priority)
        classes = service.queue.classes.values()
        class_name = next((c.name for c in classes if c.priority == level), None)
        prompt: dict[str, Any] = {"prompt_token_ids": req.prompt_token_ids}
        if req.prompt is not None:
            prompt["prompt"] = req.prompt
        # Its own id here: a request that moves back to this server is a new request.
        request_id = f"{req.request_id}.{uuid.uuid4().hex[:8]}"
        lora_name = None if req.model == service.name else req.model  # an adapter's name
        admitted = service.admit(request_id, [prompt], lambda: params_from_http(req.params),
                                 class_name, priority, resume=req.resume,
                                 lora_name=lora_name)  # fmt: skip
        try:
            streams = await unless_disconnected(request, admitted)
        except ClientGone:
            raise
        except Exception as e:
            raise engine_error(e) from None
        return FramesResponse(streams[0])

    @router.get(LOAD_PATH)
    async def load(model: str | None = None) -> Response:
        report = load_report(service_for(model), ctx)
        return Response(msgspec.json.encode(report), media_type="application/json")

    return router


def decode_request(request: Request, raw: bytes) -> GenerateRequest:
    declared = request.headers.get("content-type", "")
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type == MSGPACK:
        decode: Any = msgspec.msgpack.decode
    elif media_type == "application/json":
        decode = msgspec.json.decode
    else:
        raise APIError(415, f"Content-Type must be {MSGPACK} or application/json "
                       f"(got {declared[:80]!r})", code="unsupported_media_type")  # fmt: skip
    try:
        return decode(raw, type=GenerateRequest)  # type: ignore[no-any-return]
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rpartition("at `$.")[2].rstrip("`") if "at `$." in text else None
        raise APIError(400, text, param) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"the body is not valid {media_type}: {e}") from None


class FramesResponse(SSEResponse):
    """The request's frames; however the response ends (finished, failed, the gateway
    gone even before the first frame), the request is closed: aborted if unfinished."""

    def __init__(self, stream: FleetStream) -> None:
        super().__init__(frames(stream), media_type=FRAMES)
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()


async def frames(stream: FleetStream) -> AsyncIterator[bytes]:
    """The request's deltas, each in one frame as it is (a delta in, a delta out)."""
    writer = FrameWriter()
    try:
        async for out in stream:
            yield writer.output(out)
    except Exception as e:  # noqa: BLE001 -- every failure must reach the gateway as a frame
        try:
            err = engine_error(e)
        except Exception:  # noqa: BLE001 -- not one it knows: another replica may do better
            err = APIError(500, f"internal error: {type(e).__name__}")
        # The server's state (draining, a dead engine, a shed) is no fault of the request.
        retry = err.status >= 500
        yield writer.error(ErrorFrame(err.status, err.message, err.code, err.param, retry))


def load_report(service: GenerateService, ctx: ServingContext) -> LoadReport:
    members = list(service.replica_set)
    live = service.replica_set.live
    stats = [r.stats or EngineStats() for r in live]
    latencies = [s for s in (r.step_latency_s for r in live) if s is not None]
    capacities = [c for c in (r.kv_capacity_tokens for r in live) if c]
    queries = sum(s.prefix_cache_queries for s in stats)
    hits = sum(s.prefix_cache_hits for s in stats)
    left = None
    if ctx.draining and ctx.drain_deadline is not None:
        left = max(0.0, ctx.drain_deadline - time.monotonic())
    return LoadReport(
        model=service.name,
        healthy=service.is_ready and not ctx.draining and service.dead_reason is None,
        draining=ctx.draining,
        drain_left_s=left,
        dead_reason=service.dead_reason,
        num_replicas=len(live),
        num_outstanding_requests=len(service.queue)
        + sum(r.num_outstanding_requests for r in members),
        num_outstanding_tokens=sum(r.num_outstanding_tokens for r in members),
        queue_depth=sum(service.waiting_by_class().values()),
        num_requests_running=sum(s.num_requests_running for s in stats),
        kv_cache_usage_perc=(
            sum(s.kv_cache_usage_perc for s in stats) / len(stats) if stats else 0.0
        ),
        kv_capacity_tokens=min(capacities) if capacities else None,
        # Its seats: a batch per live replica (the rest waits in its class queue).
        max_num_seqs=service.config.scheduler.max_num_seqs * max(1, len(live)),
        step_latency_s=sum(latencies) / len(latencies) if latencies else None,
        num_steps=sum(s.num_steps for s in stats),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        lora_adapters=sorted({n for r in live for n in r.lora_names}),
    )
