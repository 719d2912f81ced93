"""Loading and unloading LoRA adapters while serving (vLLM's routes and bodies).

    POST /v1/load_lora_adapter    {"lora_name": N, "lora_path": P[, "model": BASE]}
    POST /v1/unload_lora_adapter  {"lora_name": N[, "model": BASE]}

Admin routes: the API key when the server has one, else loopback clients only. `model`
(a fleetserve addition) names the base model when several generate models serve LoRA.
A bad adapter (not a PEFT folder, rank above max_lora_rank, unknown target modules, the
shapes of another base model) is a 400 naming the problem; an unknown name to unload a
404 naming it. Unloading lets the adapter's requests in flight finish.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fleetserve.entrypoints.openai.admin import admin_guard
from fleetserve.entrypoints.openai.errors import APIError, from_value_error
from fleetserve.entrypoints.openai.serving_common import ServingContext, parse, read_body
from fleetserve.serve.services.adapters import AdapterTable, UnknownAdapterError
from fleetserve.serve.services.service_registry import ModelService


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=256)
    model: str | None = None


def adapter_table(service: ModelService | None) -> AdapterTable | None:
    """A generate model's adapters (the local GenerateService's or Ray's client's), or None."""
    table = getattr(service, "adapters", None)
    return table if isinstance(table, AdapterTable) else None


def lora_router(ctx: ServingContext, key_required: bool) -> APIRouter:
    router = APIRouter()

    def base_model(name: str | None) -> tuple[ModelService, AdapterTable]:
        if name is not None:
            service = ctx.model(name, "generate")
            table = adapter_table(service)
            if table is None or not table.enabled:
                raise APIError(400, f"the model {name!r} does not serve LoRA adapters", "model")
            return service, table
        with_lora = [
            (s, t) for s in ctx.registry if (t := adapter_table(s)) is not None and t.enabled
        ]
        if len(with_lora) != 1:
            names = ", ".join(repr(s.name) for s, _ in with_lora) or "none"
            raise APIError(
                400,
                f"model is required: the models that serve LoRA adapters are {names}",
                "model",
            )
        return with_lora[0]

    @router.post("/v1/load_lora_adapter")
    async def load(request: Request) -> JSONResponse:
        admin_guard(request, key_required)
        body = parse(LoadLoRAAdapterRequest, await read_body(ctx, request))
        service, table = base_model(body.model)
        if ctx.registry.services.get(body.lora_name) is not None:
            raise APIError(400, f"lora_name {body.lora_name!r} is a model's name", "lora_name")
        owner = ctx.registry.adapter_owner(body.lora_name)
        if owner is not None and owner is not service:
            raise APIError(
                400, f"lora_name {body.lora_name!r} is an adapter of {owner.name!r}", "lora_name"
            )
        try:
            await table.load(body.lora_name, body.lora_path)
        except ValueError as e:
            raise from_value_error(e) from None
        return JSONResponse(
            {"object": "lora_adapter", "id": body.lora_name, "parent": service.name,
             "root": body.lora_path, "status": "loaded"}
        )  # fmt: skip

    @router.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        admin_guard(request, key_required)
        body = parse(UnloadLoRAAdapterRequest, await read_body(ctx, request))
        owner = ctx.registry.adapter_owner(body.lora_name)
        if body.model is not None:
            service, _ = base_model(body.model)
            if owner is not service:
                owner = None
        table = adapter_table(owner)
        if owner is None or table is None:
            raise APIError(
                404,
                f"the LoRA adapter {body.lora_name!r} does not exist",
                "lora_name",
                "model_not_found",
            )
        try:
            table.unload(body.lora_name)
        except UnknownAdapterError as e:
            raise APIError(404, str(e), "lora_name", "model_not_found") from None
        return JSONResponse(
            {"object": "lora_adapter", "id": body.lora_name, "parent": owner.name,
             "status": "unloaded"}
        )  # fmt: skip

    return router
