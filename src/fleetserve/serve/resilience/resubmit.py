"""GenerateService's side of request migration (serve/resilience/migration.py's `Resubmitter`): puts
a request whose replica was lost, or a hedge's copy, on another live replica through the
service's Router, going on from the output its reader last got.

When no replica can take it now but one is on its way (loading, or about to be started by
the pool controller), it waits up to `migration_wait_s`, woken each time the routable
replicas change (`wake`); past that, or with nothing on its way, EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fleetserve.engine.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    ReplicaGoneError,
)
from fleetserve.metrics import ModelMetrics
from fleetserve.serve.admission.admit import PreparedPrompt
from fleetserve.serve.admission.sla import ServiceClass
from fleetserve.serve.config.fleet_config import ResilienceConfig
from fleetserve.serve.contracts import Replica, ReplicaStreamLike, RouteRequest
from fleetserve.serve.request_state import FleetStream
from fleetserve.serve.resilience.migration import migration_reason
from fleetserve.serve.routing.router import NoHealthyReplicaError, Router

log = logging.getLogger("fleetserve.serve")

# Narrows the router's candidates for a class (spot first: GenerateService.narrow).
Narrow = Callable[[list[Replica]], list[Replica]]


@dataclass(frozen=True)
class SentRequest:
    """What sending an engine request again needs: its FleetStream's `context`."""

    item: PreparedPrompt
    service_class: ServiceClass
    priority: int  # the engine's: class and request folded (sla.engine_priority)


class ResubmitHost(Protocol):
    """The live state RouterResubmitter reads of its service (GenerateService)."""

    @property
    def closing(self) -> bool: ...

    @property
    def recovering(self) -> bool:
        """A replica is loading (or will be started) that a request may wait for."""
        ...

    def narrow(self, class_name: str) -> Narrow | None: ...


class RouterResubmitter:
    """Owned by one GenerateService; runs on its event loop thread."""

    def __init__(
        self,
        name: str,
        router: Router[Replica],
        resilience: ResilienceConfig,
        metrics: ModelMetrics | None,
        host: ResubmitHost,
    ) -> None:
        self.name, self.router, self.resilience = name, router, resilience
        self.metrics, self.host = metrics, host
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """The routable replicas changed: requests waiting for one look again."""
        self._changed.set()

    async def resubmit(
        self, stream: FleetStream, exclude: set[int]
    ) -> tuple[ReplicaStreamLike, int]:
        """Puts `stream`'s request on a live replica not in `exclude`, going on from the
        output its reader last got; waits up to migration_wait_s for one to be up."""
        sent: SentRequest = stream.context
        item, cls = sent.item, sent.service_class
        last = stream.state.resume_from()
        done = [] if last is None else stream.state.fold.tokens_so_far()
        route = RouteRequest(
            item.request_id,
            tuple(item.prompt["prompt_token_ids"]) + tuple(done),
            (item.params.max_tokens or 0) * item.params.n - len(done),
            sent.priority,
            None if item.lora is None else item.lora.lora_name,
        )
        wait_s = self.resilience.migration_wait_s
        deadline = time.monotonic() + wait_s
        refused = set(exclude)
        while True:
            if self.host.closing:
                raise EngineDeadError("the server is shutting down")
            narrow = self.host.narrow(cls.name)
            try:
                replica = self.router.choose(route, exclude=refused, narrow=narrow)
            except NoHealthyReplicaError:
                left = deadline - time.monotonic()
                if left <= 0 or not self.host.recovering:
                    raise EngineDeadError(
                        f"no replica of {self.name!r} could take the request over "
                        f"(waited {wait_s:g} s, migration_wait_s)"
                    ) from None
                self._changed.clear()
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                refused = set(exclude)  # a refusal may have been momentary
                continue
            try:
                inner = replica.submit(
                    item.request_id,
                    item.prompt,
                    copy.copy(item.params),
                    sent.priority,
                    item.num_prompt_tokens,
                    level=cls.priority,
                    resume=last,
                    lora_request=item.lora,
                )
            except (EngineDeadError, EngineNotReadyError, EngineOverloadedError):
                refused.add(replica.index)
                continue
            return inner, replica.index

    def on_migrated(self, stream: FleetStream, error: ReplicaGoneError) -> None:
        log.info("%s: request %s moves off replica %d (%s)", self.name, stream.request_id,
                 stream.state.replica_index, error)  # fmt: skip
        if self.metrics is not None:
            self.metrics.add_migration(migration_reason(error))
