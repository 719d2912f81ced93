"""The fleet client a custom handler calls other models with (DESIGN.md: "Handlers call the
fleet through one seam"), gateway side: each call goes through the callee's own service
(its class queues, routing, migration, metrics under the callee's model_name), never HTTP
to ourselves, and returns the JSON body the HTTP endpoint would return, as a dict.

A handler in its own process (serve/microbatch/isolated.py) reaches this client over its
pipe: handler_proc.ProcFleetClient sends ("fleet", (call_id, method, args, kwargs)), the
parent runs `call` here on the server's event loop and answers ("fleet_reply", ...).
A sub-call never waits longer than its parent's call may (`timeout_s`), and ends (its
engine requests aborted) when the parent's call ends first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.openai.protocol_embed import EmbeddingRequest
from fleetserve.entrypoints.openai.serving_common import (
    ModelContext,
    collect,
    engine_error,
    new_id,
    parse,
)
from fleetserve.serve.services.service_registry import Registry

METHODS = ("chat", "complete", "embed", "predict")
log = logging.getLogger("fleetserve.access")


class FleetCallError(RuntimeError):
    """A sub-call failed: `status` and `body` are what the HTTP endpoint would answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class GatewayFleetClient:
    def __init__(self, registry: Registry, class_name: str | None = None) -> None:
        self.registry = registry
        self.class_name = class_name

    async def call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """`method` by name (what the handler process's RPC carries)."""
        if method not in METHODS:
            raise FleetCallError(400, f"no fleet method {method!r}; there are {METHODS}")
        result: dict[str, Any] = await getattr(self, method)(*args, **kwargs)
        return result

    def _service(self, model: str, kind: str) -> Any:
        service = self.registry.services.get(model)
        if service is None:
            names = ", ".join(sorted(self.registry.services))
            raise FleetCallError(404, f"the model {model!r} does not exist; this fleet has {names}")
        if service.kind != kind:
            raise FleetCallError(400, f"the model {model!r} is a {service.kind} model, not {kind}")
        return service

    async def _generate(self, service: Any, prompts: list[Any], base: Any, prefix: str) -> Any:
        try:
            streams = await service.admit(
                new_id(prefix), prompts, lambda: _copy(base), self.class_name, 0
            )
            return await collect(streams)
        except APIError as e:
            raise FleetCallError(e.status, e.message) from None
        except (ValueError, LookupError, RuntimeError) as e:
            err = engine_error(e)
            raise FleetCallError(err.status, err.message) from None

    async def chat(
        self, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> dict[str, Any]:
        from fleetserve.entrypoints.openai.serving_chat import chat_completion_body, chat_inputs

        service = self._service(model, "generate")
        req = _parse(ChatCompletionRequest, {"model": model, "messages": messages, **params})
        ctx = ModelContext(service, model)
        prompt, base = _wrap(chat_inputs, ctx, req)
        (final,) = await self._generate(service, [prompt], base, "chatcmpl")
        return chat_completion_body(ctx, req, new_id("chatcmpl"), final)

    async def complete(self, model: str, prompt: Any, **params: Any) -> dict[str, Any]:
        from fleetserve.entrypoints.openai.serving_completion import (
            completion_body,
            completion_inputs,
        )

        service = self._service(model, "generate")
        req = _parse(CompletionRequest, {"model": model, "prompt": prompt, **params})
        prompts, base = _wrap(completion_inputs, req)
        finals = await self._generate(service, prompts, base, "cmpl")
        return completion_body(ModelContext(service, model), req, new_id("cmpl"), finals)

    async def embed(self, model: str, inputs: Any, **params: Any) -> dict[str, Any]:
        from fleetserve.entrypoints.openai.serving_embedding import create_embedding

        service = self._service(model, "embed")
        req = _parse(EmbeddingRequest, {"model": model, "input": inputs, **params})
        try:
            return await create_embedding(service, req)
        except APIError as e:
            raise FleetCallError(e.status, e.message) from None

    async def predict(self, model: str, instances: list[dict[str, Any]]) -> dict[str, Any]:
        from fleetserve.entrypoints.openai.protocol_embed import PredictRequest
        from fleetserve.entrypoints.openai.serving_predict import predict

        service = self._service(model, "custom")
        try:
            return await predict(service, _parse(PredictRequest, {"instances": instances}))
        except APIError as e:
            raise FleetCallError(e.status, e.message) from None


def _copy(base: Any) -> Any:
    import copy

    return copy.copy(base)


def _parse(model: Any, body: dict[str, Any]) -> Any:
    try:
        return parse(model, body)
    except APIError as e:
        raise FleetCallError(e.status, e.message) from None


def _wrap(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except APIError as e:
        raise FleetCallError(e.status, e.message) from None


def bind_fleet_clients(registry: Registry, loop: asyncio.AbstractEventLoop) -> None:
    """Gives every custom model's handler process its way to the fleet (at startup)."""
    client = GatewayFleetClient(registry)
    for service in registry:
        bind = getattr(service, "bind_fleet", None)
        if bind is None:
            continue

        async def call(
            method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float,
            parent: str = service.name,
        ) -> dict[str, Any]:  # fmt: skip
            start = time.monotonic()
            outcome = "error"
            try:
                result = await asyncio.wait_for(client.call(method, args, kwargs), timeout_s)
                outcome = "ok"
                return result
            except TimeoutError:
                outcome = "deadline"
                raise FleetCallError(
                    504, f"the sub-call ran past its parent's deadline ({timeout_s:.3g} s)"
                ) from None
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                callee = args[0] if args else "?"
                log.info(
                    "sub-call of %s: %s(%s) %s in %.1f ms",
                    parent,
                    method,
                    callee,
                    outcome,
                    (time.monotonic() - start) * 1e3,
                )

        bind(call, loop)
