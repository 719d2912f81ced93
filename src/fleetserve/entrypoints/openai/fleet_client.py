"""The fleet client a custom handler calls other models with (DESIGN.md: "Handlers call the
fleet through one seam"), gateway side: each call goes through the callee's own service
(its class queues, routing, migration, metrics under the callee's model_name), never HTTP
to ourselves, and returns the JSON body the HTTP endpoint would return, as a dict.

A handler in its own process (serve/microbatch/isolated.py) reaches this client over its
pipe: handler_proc.ProcFleetClient sends ("fleet", (call_id, method, args, kwargs)), the
parent runs `call` here on the server's event loop and answers ("fleet_reply", ...); a
streaming method's chunks go down the pipe one reply each as they come (`emit`).
A sub-call never waits longer than its parent's call may (`timeout_s`), and ends (its
engine requests aborted) when the parent's call ends first.

Scope of a client (`GatewayFleetClient.scoped`): the caller's class (each sub-call is
admitted in it, as the parent was) and the caller's deadline (a monotonic time: every
sub-call is bounded by what is left of it, 504 past it, its engine requests aborted). Each
finished sub-call is recorded in `calls` (SubCall: model, method, status, ms) for the
parent's access-log line. `FleetClient` (serve/pipelines/graph_executor.py) is the typed
protocol every backend keeps (this client, the handler process's ProcFleetClient, graphs'
executor).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.fleet_stream import stream_chunks
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.openai.protocol_embed import EmbeddingRequest
from fleetserve.entrypoints.openai.serving_common import (
    ModelContext,
    collect,
    engine_error,
    new_id,
    parse,
)
from fleetserve.serve.pipelines.graph_executor import FleetClient
from fleetserve.serve.services.service_registry import Registry

METHODS = ("chat", "complete", "embed", "predict")
STREAM_METHODS = ("chat_stream", "complete_stream")  # over a handler's pipe: chunk by chunk
log = logging.getLogger("fleetserve.access")
T = TypeVar("T")


class StreamingFleetClient(FleetClient, Protocol):
    """A FleetClient that also streams: the chunk dicts the endpoint would stream."""

    def chat_stream(
        self, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> AsyncIterator[dict[str, Any]]: ...

    def complete_stream(
        self, model: str, prompt: Any, **params: Any
    ) -> AsyncIterator[dict[str, Any]]: ...


@dataclass(frozen=True)
class SubCall:
    """One finished sub-call, for its parent's access-log line."""

    model: str
    method: str
    status: int  # 200, the error's status, 504 past the deadline, 499 cancelled
    ms: float

    def __str__(self) -> str:
        return f"{self.method}({self.model}) {self.status} {self.ms:.1f}ms"


class FleetCallError(RuntimeError):
    """A sub-call failed: `status` and `body` are what the HTTP endpoint would answer."""

    def __init__(self, status: int, message: str, past_deadline: bool = False) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        # The sub-call ended at its parent's deadline: the caller answers with the deadline's
        # 504 on this, not by reading the clock again (the timer may fire a fraction of a ms
        # before the deadline it was set from: seen under load, 5 of 40 such calls).
        self.past_deadline = past_deadline


class GatewayFleetClient:
    def __init__(
        self,
        registry: Registry,
        class_name: str | None = None,
        deadline: float | None = None,
    ) -> None:
        self.registry = registry
        self.class_name = class_name
        self.deadline = deadline  # time.monotonic() past which no sub-call may run
        self.calls: list[SubCall] = []

    def scoped(self, class_name: str | None, deadline: float | None) -> GatewayFleetClient:
        """A client for one parent request: its class, its deadline, its own `calls`."""
        return GatewayFleetClient(self.registry, class_name, deadline)

    async def _bounded(self, model: str, method: str, work: Awaitable[T], record: bool = True) -> T:
        """Runs one sub-call (or one step of a stream: `record` False) within what is left
        of the deadline; records it in `calls`."""
        start = time.monotonic()
        status = 500
        try:
            if self.deadline is None:
                result = await work
            else:
                remaining = self.deadline - start
                if remaining <= 0:
                    if asyncio.iscoroutine(work):
                        work.close()
                    raise TimeoutError
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the inner
                # result when a cancel arrives just as it completes, swallowing the cancel
                # (a parent's abandoned stream then ran its sub-call to the end: each chunk
                # of a stream is one such wait).
                async with asyncio.timeout(remaining):
                    result = await work
            status = 200
            return result
        except TimeoutError:
            status = 504
            raise FleetCallError(
                504, f"the sub-call to {model!r} ran past its parent's deadline", True
            ) from None
        except FleetCallError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            if record:
                ms = (time.monotonic() - start) * 1e3
                self.calls.append(SubCall(model, method, status, ms))

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
        streams = await self._admit(service, prompts, base, prefix)
        try:
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

        async def run() -> dict[str, Any]:
            service = self._service(model, "generate")
            req = _parse(ChatCompletionRequest, {"model": model, "messages": messages, **params})
            ctx = ModelContext(service, model)
            prompt, base = _wrap(chat_inputs, ctx, req)
            (final,) = await self._generate(service, [prompt], base, "chatcmpl")
            return chat_completion_body(ctx, req, new_id("chatcmpl"), final)

        return await self._bounded(model, "chat", run())

    async def complete(self, model: str, prompt: Any, **params: Any) -> dict[str, Any]:
        from fleetserve.entrypoints.openai.serving_completion import (
            completion_body,
            completion_inputs,
        )

        async def run() -> dict[str, Any]:
            service = self._service(model, "generate")
            req = _parse(CompletionRequest, {"model": model, "prompt": prompt, **params})
            prompts, base = _wrap(completion_inputs, req)
            finals = await self._generate(service, prompts, base, "cmpl")
            return completion_body(ModelContext(service, model), req, new_id("cmpl"), finals)

        return await self._bounded(model, "complete", run())

    async def _admit(self, service: Any, prompts: list[Any], base: Any, prefix: str) -> Any:
        try:
            return await service.admit(
                new_id(prefix), prompts, lambda: _copy(base), self.class_name, 0
            )
        except APIError as e:
            raise FleetCallError(e.status, e.message) from None
        except (ValueError, LookupError, RuntimeError) as e:
            err = engine_error(e)
            raise FleetCallError(err.status, err.message) from None

    async def _open_stream(
        self, model: str, method: str, opening: Awaitable[AsyncIterator[str]]
    ) -> AsyncIterator[str]:
        """Admits a stream within the deadline; a stream that cannot open is recorded."""
        start = time.monotonic()
        try:
            return await self._bounded(model, method, opening, record=False)
        except FleetCallError as e:
            self.calls.append(SubCall(model, method, e.status, (time.monotonic() - start) * 1e3))
            raise

    async def chat_stream(
        self, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """The chat.completion.chunk dicts the endpoint would stream (fleet_stream.py)."""
        from fleetserve.entrypoints.openai.serving_chat import _stream, chat_inputs

        body = {"model": model, "messages": messages, **params, "stream": True}

        async def open_() -> AsyncIterator[str]:
            service = self._service(model, "generate")
            req = _parse(ChatCompletionRequest, body)
            ctx = ModelContext(service, model)
            prompt, base = _wrap(chat_inputs, ctx, req)
            request_id = new_id("chatcmpl")
            streams = await self._admit(service, [prompt], base, "chatcmpl")
            return _stream(ctx, req, request_id, streams)

        sse = await self._open_stream(model, "chat_stream", open_())
        async for chunk in stream_chunks(self, model, "chat_stream", sse):
            yield chunk

    async def complete_stream(
        self, model: str, prompt: Any, **params: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """The text_completion chunk dicts the endpoint would stream (fleet_stream.py)."""
        from fleetserve.entrypoints.openai.serving_completion import _stream, completion_inputs

        body = {"model": model, "prompt": prompt, **params, "stream": True}

        async def open_() -> AsyncIterator[str]:
            service = self._service(model, "generate")
            req = _parse(CompletionRequest, body)
            prompts, base = _wrap(completion_inputs, req)
            streams = await self._admit(service, prompts, base, "cmpl")
            return _stream(ModelContext(service, model), req, new_id("cmpl"), streams)

        sse = await self._open_stream(model, "complete_stream", open_())
        async for chunk in stream_chunks(self, model, "complete_stream", sse):
            yield chunk

    async def embed(self, model: str, inputs: Any, **params: Any) -> dict[str, Any]:
        from fleetserve.entrypoints.openai.serving_embedding import create_embedding

        async def run() -> dict[str, Any]:
            service = self._service(model, "embed")
            req = _parse(EmbeddingRequest, {"model": model, "input": inputs, **params})
            try:
                return await create_embedding(service, req)
            except APIError as e:
                raise FleetCallError(e.status, e.message) from None

        return await self._bounded(model, "embed", run())

    async def predict(self, model: str, instances: list[dict[str, Any]]) -> dict[str, Any]:
        from fleetserve.entrypoints.openai.protocol_embed import PredictRequest
        from fleetserve.entrypoints.openai.serving_predict import predict

        async def run() -> dict[str, Any]:
            service = self._service(model, "custom")
            try:
                body = _parse(PredictRequest, {"instances": instances})
                return await predict(service, body, self.class_name)
            except APIError as e:
                raise FleetCallError(e.status, e.message) from None

        return await self._bounded(model, "predict", run())


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


def strictest(registry: Registry, classes: frozenset[str | None]) -> str | None:
    """The class a micro-batch's sub-calls take: of the classes of the requests in it, the
    one that goes first (the lowest priority number; None is the fleet's default class).
    One class (the usual case) is that class; a name the fleet does not know is skipped."""
    if len(classes) <= 1:
        return next(iter(classes), None)
    admission = next((s.admission for s in registry if hasattr(s, "admission")), None)
    if admission is None:
        return None
    ranked = []
    for name in classes:
        try:
            ranked.append((admission.resolve(name, 0).priority, name is None, name))
        except ValueError:
            continue
    return min(ranked)[2] if ranked else None


def bind_fleet_clients(registry: Registry, loop: asyncio.AbstractEventLoop) -> None:
    """Gives every custom model's handler process its way to the fleet (at startup)."""
    client = GatewayFleetClient(registry)
    for service in registry:
        bind = getattr(service, "bind_fleet", None)
        if bind is None:
            continue

        async def call(
            method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float,
            classes: frozenset[str | None] = frozenset(),
            sinks: list[list[Any]] | None = None, parent: str = service.name,
            emit: Callable[[dict[str, Any]], None] | None = None,
        ) -> dict[str, Any]:  # fmt: skip
            cls = strictest(registry, classes)
            scoped = client.scoped(cls, time.monotonic() + timeout_s)
            try:
                if method in STREAM_METHODS and emit is not None:
                    stream = getattr(scoped, method)(*args, **kwargs)
                    try:
                        async for chunk in stream:
                            emit(chunk)
                    finally:
                        await stream.aclose()
                    return {}
                return await scoped.call(method, args, kwargs)
            finally:
                for sub in scoped.calls:
                    log.info("sub-call of %s: %s", parent, sub)
                    for sink in sinks or ():  # each parent request's access-log line
                        sink.append(sub)

        bind(call, loop)
