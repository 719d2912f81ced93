"""The fleet client on Ray: composition through Serve deployment handles, never HTTP to
ourselves.

The ingress (ingress.py) holds what a sub-call must go through: the callees' class queues,
routing, migration and metrics (its registry of Ray clients, clients.py and
microbatch_clients.py). So composition runs there, with the local server's own
GatewayFleetClient (entrypoints/openai/fleet_client.py) over that registry:

- a graph or a cascade is a service of the ingress's registry, as on the local server; its
  steps and tiers are admissions to the callees' Ray clients;
- a custom handler runs in a MicroBatchReplica (deployments.py), in its own process
  (serve/microbatch/isolated.py). Its sub-calls (ProcFleetClient -> the replica's event
  loop) go up to the ingress through the ingress deployment's handle
  (`FleetIngress.fleet_call`, `HandleFleetCall` here), run there in the parent request's
  class within what is left of its deadline, and come back as `FleetReply` values with the
  SubCall records; the replica returns those with its predictions (`Predicted`), and the
  ingress's RayCustomClient puts them on the parent's access-log line. A sub-call the
  handler stops waiting for (its call ended, timed out or was cancelled) is cancelled at
  the ingress, which aborts the callee's engine requests. A streamed sub-call
  (`chat_stream`, `complete_stream`) goes through the handle's streaming call
  (`FleetIngress.fleet_call_stream`): the callee's chunks come back one by one as they
  are made, and a closing FleetReply ends the stream with its status and records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fleetserve.entrypoints.openai.fleet_client import (
    STREAM_METHODS,
    FleetCallError,
    GatewayFleetClient,
    SubCall,
    strictest,
)
from fleetserve.serve.services.service_registry import Registry

INGRESS_DEPLOYMENT = "ingress"
log = logging.getLogger("fleetserve.access")


@dataclass(frozen=True)
class FleetReply:
    """One sub-call's answer, as data across the handle: the body (ok) or the HTTP status
    and message the endpoint would have answered, and the SubCalls it made."""

    ok: bool
    body: dict[str, Any] | None
    status: int = 200
    message: str = ""
    calls: tuple[SubCall, ...] = ()


@dataclass(frozen=True)
class Predicted:
    """A custom replica's answer to one predict: its predictions and the sub-calls its
    handler made for the batch(es) holding them (for the parent's access-log line)."""

    predictions: list[Any]
    sub_calls: tuple[SubCall, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class FleetCall:
    """One handler sub-call as it crosses the ingress's handle: the parent request it
    belongs to, the fleet method and its arguments, what is left of the parent's deadline
    and the batch's classes (the strictest of them admits it)."""

    parent: str
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    timeout_s: float
    classes: tuple[str | None, ...] = ()


def _scoped_client(registry: Registry, call: FleetCall) -> GatewayFleetClient:
    """The registry's fleet client scoped to the call's class and deadline."""
    cls = strictest(registry, frozenset(call.classes))
    return GatewayFleetClient(registry).scoped(cls, time.monotonic() + call.timeout_s)


def _failed_reply(e: Exception, scoped: GatewayFleetClient) -> FleetReply:
    """A sub-call's failure as its FleetReply: a FleetCallError's status and message, or a
    400 for a handler's bad arguments (TypeError, ValueError: an unknown param)."""
    calls = tuple(scoped.calls)
    if isinstance(e, FleetCallError):
        return FleetReply(False, None, e.status, str(e).split(": ", 1)[-1], calls)
    return FleetReply(False, None, 400, str(e), calls)


def _log_calls(call: FleetCall, scoped: GatewayFleetClient) -> None:
    for sub in scoped.calls:
        log.info("sub-call of %s: %s", call.parent, sub)


async def run_fleet_call(registry: Registry, call: FleetCall) -> FleetReply:
    """At the ingress: one handler sub-call through the callee's Ray client, admitted in
    the strictest of the batch's classes, bounded by what is left of the parent's
    deadline. Cancelling it cancels the callee's requests."""
    scoped = _scoped_client(registry, call)
    try:
        body = await scoped.call(call.method, list(call.args), dict(call.kwargs))
        return FleetReply(True, body, calls=tuple(scoped.calls))
    except (FleetCallError, TypeError, ValueError) as e:
        return _failed_reply(e, scoped)
    finally:
        _log_calls(call, scoped)


async def run_fleet_stream(
    registry: Registry, call: FleetCall
) -> AsyncIterator[dict[str, Any] | FleetReply]:
    """At the ingress: one streamed handler sub-call (its method one of STREAM_METHODS):
    the callee's chunks as they come, then one FleetReply that closes the stream (ok, or
    the status and message it ended with) carrying its SubCalls. Closing the generator
    early (the handler stopped reading) closes the callee's stream, which aborts its
    requests."""
    if call.method not in STREAM_METHODS:
        yield FleetReply(False, None, 400, f"no streaming fleet method {call.method!r}; there "
                         f"are {STREAM_METHODS}")  # fmt: skip
        return
    scoped = _scoped_client(registry, call)
    reply: FleetReply
    try:
        stream = getattr(scoped, call.method)(*call.args, **call.kwargs)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()
        reply = FleetReply(True, {}, calls=tuple(scoped.calls))
    except (FleetCallError, TypeError, ValueError) as e:
        reply = _failed_reply(e, scoped)
    finally:
        _log_calls(call, scoped)
    yield reply


class HandleFleetCall:
    """In a custom model's replica: what its handler process's sub-calls run with
    (CustomService.bind_fleet's `call`): each goes to the ingress deployment's
    `fleet_call` through its handle; its SubCalls are appended to the parent requests'
    `sinks`. The handle is looked up at the first sub-call (the ingress is deployed after
    the models it calls)."""

    def __init__(self, parent: str, app_name: str | None, ingress: str = INGRESS_DEPLOYMENT):
        self.parent = parent
        self.app_name = app_name
        self.ingress = ingress
        self._handle: Any = None

    def handle(self) -> Any:
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_deployment_handle(self.ingress, self.app_name or "default")
        return self._handle

    async def __call__(
        self,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout_s: float,
        classes: frozenset[str | None] = frozenset(),
        sinks: list[list[Any]] | None = None,
        emit: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        if emit is not None and method in STREAM_METHODS:
            reply = await self._stream(method, args, kwargs, timeout_s, classes, emit)
        else:
            reply = await self._call(method, args, kwargs, timeout_s, classes)
        for sink in sinks or ():
            sink.extend(reply.calls)
        if not reply.ok:
            raise FleetCallError(reply.status, reply.message)
        assert reply.body is not None
        return reply.body

    def _unreachable(self, e: Exception) -> FleetCallError:
        return FleetCallError(503, f"the fleet is not reachable from {self.parent!r}: {e}")

    async def _call(
        self, method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float,
        classes: frozenset[str | None],
    ) -> FleetReply:  # fmt: skip
        try:
            call = FleetCall(self.parent, method, args, kwargs, timeout_s, tuple(classes))
            response = self.handle().fleet_call.remote(call)
        except Exception as e:  # noqa: BLE001 -- no ingress to reach: the sub-call fails
            raise self._unreachable(e) from e
        try:
            reply: FleetReply = await response
        except asyncio.CancelledError:
            response.cancel()  # the ingress cancels the callee's requests
            raise
        except Exception as e:  # noqa: BLE001 -- the ingress failed the call
            raise FleetCallError(500, f"the sub-call to the fleet failed: {e}") from None
        return reply

    async def _stream(
        self, method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float,
        classes: frozenset[str | None], emit: Callable[[dict[str, Any]], None],
    ) -> FleetReply:  # fmt: skip
        """A streamed sub-call: each chunk the ingress yields goes to `emit` (down the
        handler's pipe) as it comes; the closing FleetReply is the answer."""
        try:
            handle = self.handle().options(stream=True)
            call = FleetCall(self.parent, method, args, kwargs, timeout_s, tuple(classes))
            chunks = handle.fleet_call_stream.remote(call)
        except Exception as e:  # noqa: BLE001 -- no ingress to reach: the sub-call fails
            raise self._unreachable(e) from e
        try:
            async for item in chunks:
                if isinstance(item, FleetReply):
                    return item
                emit(item)
        except asyncio.CancelledError:
            chunks.cancel()  # the handler stopped reading: the ingress closes the stream
            raise
        except Exception as e:  # noqa: BLE001 -- the ingress failed the call
            raise FleetCallError(500, f"the sub-call to the fleet failed: {e}") from None
        raise FleetCallError(500, f"the streamed sub-call {method} ended without its reply")
