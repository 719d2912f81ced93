"""What the completion and chat handlers share: body parsing, engine errors, disconnects,
merging several prompts' streams, SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from fleetserve import cpu_work
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
)
from fleetserve.entrypoints.openai.access_log import access_record, note_model
from fleetserve.entrypoints.openai.body import ClientGone, read_json
from fleetserve.entrypoints.openai.deadline import exceeded, remaining_s
from fleetserve.entrypoints.openai.errors import (
    APIError,
    error_body,
    from_validation_error,
    from_value_error,
)
from fleetserve.outputs import RequestOutput
from fleetserve.serve.admission.admit import ShedError
from fleetserve.serve.admission.sla import ClassQueue
from fleetserve.serve.request_state import FleetStream, StatefulStream
from fleetserve.serve.services.adapters import UnknownAdapterError
from fleetserve.serve.services.service_registry import (
    ModelService,
    Registry,
    UnknownModelError,
    WrongKindError,
)
from fleetserve.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

RETRY_AFTER_S = 1
CLASS_HEADER = "X-Fleetserve-Class"
# A dead engine comes back only when an orchestrator replaces the server: retry later.
RETRY_AFTER_DEAD_S = 10


@runtime_checkable
class GenerateFrontend(Protocol):
    """What the completion and chat handlers need of a generate model: GenerateService
    here, fleetserve.ray's client of a Serve deployment on Ray."""

    name: str
    tokenizer: Tokenizer

    @property
    def max_model_len(self) -> int: ...

    @property
    def queue(self) -> ClassQueue[Any]:
        """Its SLA class queue (which classes it has, how many wait in each)."""
        ...

    async def admit(
        self,
        request_id: str,
        prompts: list[Any],
        params_for: Callable[[], SamplingParams],
        class_name: str | None = None,
        priority: int = 0,
        *,
        lora_name: str | None = None,
    ) -> Sequence[FleetStream]: ...


@dataclass(frozen=True)
class ModelContext:
    """The model one request is for: its service (tokenizer, admission) and its name."""

    engine: GenerateFrontend
    served_model_name: str
    # The fleet file's `tool_parser:` for the model (None: by its chat template).
    tool_parser: str | None = None
    # The LoRA adapter the request names as its model (None: the base model).
    lora_name: str | None = None


@dataclass
class ServingContext:
    registry: Registry
    max_body_bytes: int
    read_timeout_s: float = 15.0
    draining: bool = False
    drain_deadline: float | None = None  # time.monotonic() when draining ends

    def model(self, name: str | None, kind: str) -> ModelService:
        """The model called `name` for an endpoint serving `kind`: 404 if unknown, 400 if
        of another kind."""
        try:
            return self.registry.get(name, kind)
        except UnknownModelError as e:
            raise APIError(404, shorten(str(e), 400), "model", "model_not_found") from None
        except WrongKindError as e:
            raise APIError(400, shorten(str(e), 400), "model", "wrong_model_kind") from None

    def cascade(self, name: str | None) -> Any:
        """The cascade called `name` (serve/pipelines/cascade.py), or None."""
        service = self.registry.services.get(name) if name is not None else None
        return service if service is not None and service.kind == "cascade" else None

    def graph(self, name: Any) -> Any:
        """The graph called `name` (serve/pipelines/graph_service.py), or None."""
        service = self.registry.services.get(name) if isinstance(name, str) else None
        return service if service is not None and service.kind == "graph" else None

    def generate_model(self, name: str | None) -> ModelContext:
        service = self.model(name, "generate")
        assert isinstance(service, GenerateFrontend)
        tool_parser = getattr(service, "tool_parser", None)
        if name is not None and name != service.name:  # one of its LoRA adapters
            return ModelContext(service, name, tool_parser, name)
        return ModelContext(service, service.name, tool_parser)


def service_class(request: Request, service_tier: str | None) -> str | None:
    """The class a request asks for: the X-Fleetserve-Class header or the body's
    service_tier (OpenAI's "auto" and "default" mean the server's default class);
    None for the default. Both given and different: 400."""
    header = request.headers.get(CLASS_HEADER)
    body = None if service_tier in ("auto", "default") else service_tier
    if header is not None and body is not None and header != body:
        raise APIError(
            400,
            f"service_tier {shorten(body)!r} and the {CLASS_HEADER} header "
            f"{shorten(header)!r} name different classes",
            "service_tier",
        )
    return header if header is not None else body


def note_request(request: Request, ctx: ModelContext, class_name: str | None) -> None:
    """Tells the access log (and the response counts) the model and class a request is
    for; a class the model lacks is left out (admission refuses it with a 400)."""
    try:
        resolved: str | None = ctx.engine.queue.resolve(class_name).name
    except ValueError:
        resolved = None
    note_model(request, ctx.served_model_name, resolved)


def shorten(text: str, limit: int = 200) -> str:
    """User text echoed in an error message, cut so a huge field is not sent back whole."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


async def read_body(ctx: ServingContext, request: Request) -> dict[str, Any]:
    return await read_json(request, ctx.max_body_bytes, ctx.read_timeout_s)


def _tokenize(ctx: ModelContext, prompt: str) -> dict[str, Any]:
    ctx.engine.tokenizer.check_length(prompt, ctx.engine.max_model_len)
    return {"prompt": prompt, "prompt_token_ids": ctx.engine.tokenizer.encode(prompt)}


async def tokenize_large(ctx: ModelContext, prompts: list[Any]) -> list[Any]:
    """Each large text prompt tokenized on the CPU pool (off the event loop), in the
    engine's prompt form {"prompt", "prompt_token_ids"}; a small one is left for admission
    to tokenize (quicker than the hop). 400 for a prompt that cannot fit, before any of it
    is tokenized."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str) and len(prompt) > cpu_work.SMALL:
            try:
                prompt = await cpu_work.run_cpu(_tokenize, ctx, prompt)
            except ValueError as e:
                raise from_value_error(e) from None
        out.append(prompt)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def parse(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def error_status(e: Exception) -> int:
    """The HTTP status an error from admission or a stream stands for."""
    if isinstance(e, APIError):
        return e.status
    try:
        return engine_error(e).status
    except Exception:  # noqa: BLE001 -- not one of ours: the client saw a server error
        return 500


def engine_error(e: Exception) -> APIError:
    """Maps what admission and streams raise to API errors."""
    if isinstance(e, ShedError):
        return APIError(503, str(e), code=e.code, headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineNotReadyError):
        return APIError(503, str(e), code="loading", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return APIError(
            503,
            f"the engine is unavailable: {e}",
            code="engine_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_DEAD_S)},
        )
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, UnknownAdapterError):  # unloaded while the request was on its way
        return APIError(404, str(e), "model", "model_not_found")
    raise e


async def admit(
    request: Request,
    ctx: ModelContext,
    request_id: str,
    prompts: list[Any],
    params_for: Callable[[], SamplingParams],
    priority: int,
    class_name: str | None,
) -> list[FleetStream]:
    """Queues the request (one engine request per prompt, all or none) in its class and
    returns its streams once it is on a replica; a client that leaves meanwhile leaves
    the queue (ClientGone). The access log reads the streams' states."""
    try:
        streams = await unless_disconnected(
            request,
            ctx.engine.admit(
                request_id, prompts, params_for, class_name, priority, lora_name=ctx.lora_name
            ),
        )
    except ClientGone:
        raise
    except Exception as e:
        raise engine_error(e) from None
    record = access_record(request)
    if record is None:
        return list(streams)
    record.response_id = request_id
    record.watch([s.state for s in streams], error_status)
    return list(streams)


async def merged(
    streams: Sequence[StatefulStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: StatefulStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def collect(streams: Sequence[StatefulStream]) -> list[RequestOutput]:
    """Each stream's whole answer (its state's fold of the deltas), once all have ended."""
    try:
        async for _ in merged(streams):
            pass
    except Exception as e:
        raise engine_error(e) from None
    finally:
        for s in streams:
            s.close()
    assert all(s.state.num_outputs for s in streams)
    return [s.state.fold.output() for s in streams]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`, cancelling it (which aborts its requests) if the client goes away, or
    when the request's own deadline passes (deadline.py: a 504)."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    left = remaining_s(request)
    if left is not None and left <= 0:
        if asyncio.iscoroutine(work):
            work.close()
        raise exceeded(request)
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    timed_out = False
    try:
        await asyncio.wait({task, watcher}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not task.done() and not watcher.done()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if not timed_out:
                raise ClientGone()
    if timed_out:  # the request's deadline passed
        raise exceeded(request)
    return task.result()


class SSEResponse(StreamingResponse):
    """text/event-stream that always watches for the client leaving, even before the first
    byte (a queued request writes nothing for a while); leaving cancels the generator,
    whose cleanup aborts the request. Starlette does this only for older ASGI servers."""

    def __init__(
        self, content: AsyncIterator[str | bytes], media_type: str = "text/event-stream"
    ) -> None:
        super().__init__(content, media_type=media_type)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


# One encoder for every chunk: msgspec's is several times cheaper per chunk than
# json.dumps (the most CPU a streamed token costs the server); UTF-8, no ASCII escapes.
_JSON = msgspec.json.Encoder()


def sse(data: dict[str, Any]) -> str:
    return f"data: {_JSON.encode(data).decode()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: Exception) -> str:
    try:
        err = e if isinstance(e, APIError) else engine_error(e)
    except Exception:  # noqa: BLE001 -- a bug must still end the stream with a message
        err = APIError(500, "internal error")
    return sse(error_body(err.status, err.message, err.param, err.code))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(engine: GenerateFrontend, token_id: int) -> str:
    """One token's text as logprobs show it (decoded once per tokenizer and token)."""
    return _token_text(engine.tokenizer, token_id)


@functools.lru_cache(maxsize=1 << 17)
def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


# JSON has no -Infinity; OpenAI reports impossible tokens with this floor instead.
LOGPROB_FLOOR = -9999.0


def finite(lp: float | None) -> float:
    if lp is None or lp != lp or lp < LOGPROB_FLOOR:  # lp != lp: NaN
        return LOGPROB_FLOOR
    return lp


def top_entries(lps: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely entries of one position (the dict also holds the sampled token)."""
    best = sorted(lps.items(), key=lambda kv: kv[1], reverse=True)[:k]
    return [(t, finite(lp)) for t, lp in best]
