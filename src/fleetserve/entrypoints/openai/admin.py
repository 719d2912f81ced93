"""The operator's API: the replicas of each generate model, and draining one of them.

    GET  /admin/replicas                      -> {"data": [{id, model, index, state, ...}]}
    POST /admin/replicas/{model}:{index}/drain  {"timeout_s": 10}   -> 202 {id, state}

A drained replica takes no new requests at once; its requests that would not finish
within `timeout_s` move to other replicas straight away (request migration), the rest
finish or move at the end; then it is stopped and the model's supervisor starts a
replacement. This is what a spot notice does, asked for by hand (or by an orchestrator).

Authentication: with an API key, the same bearer key as /v1/. Without one, the admin API
answers only clients on the loopback interface, since anyone who can reach the port could
otherwise take replicas away.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.serving_common import ServingContext, parse, read_body
from fleetserve.serve.services.generate import GenerateService

_DEFAULT_DRAIN_S = 15.0  # GKE's spot budget; AWS and GCP give more


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(default=_DEFAULT_DRAIN_S, ge=0.0, le=3600.0)


def admin_router(ctx: ServingContext, key_required: bool) -> APIRouter:
    router = APIRouter()
    registry = ctx.registry

    def guard(request: Request) -> None:
        if key_required:
            return  # the GuardMiddleware has checked the key
        host = request.client.host if request.client is not None else ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise APIError(
                403,
                "the admin API answers only local clients when the server has no API key",
                code="forbidden",
            )

    def replicas() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for service in registry:
            if isinstance(service, GenerateService):
                out.extend({"model": service.name, **v} for v in service.replica_views())
        return out

    @router.get("/admin/replicas")
    async def list_replicas(request: Request) -> JSONResponse:
        guard(request)
        return JSONResponse({"object": "list", "data": replicas()})

    @router.post("/admin/replicas/{replica_id}/drain")
    async def drain(replica_id: str, request: Request) -> JSONResponse:
        guard(request)
        model, sep, index_text = replica_id.rpartition(":")
        service = registry.services.get(model) if sep else None
        if not isinstance(service, GenerateService) or not index_text.isdigit():
            known = ", ".join(r["id"] for r in replicas()) or "none"
            raise APIError(
                404, f"no replica {replica_id!r}; replicas: {known}", "replica_id", "not_found"
            )
        has_body = request.headers.get("content-length", "0") != "0" or (
            "transfer-encoding" in request.headers
        )
        body = parse(DrainRequest, await read_body(ctx, request)) if has_body else DrainRequest()
        index = int(index_text)
        try:
            service.replica_set.get(index)
        except KeyError as e:
            raise APIError(404, str(e.args[0]), "replica_id", "not_found") from None
        if not service.start_drain(index, body.timeout_s):
            raise APIError(409, f"replica {replica_id!r} is already being drained", code="conflict")
        return JSONResponse({"id": replica_id, "state": "draining"}, status_code=202)

    return router
