"""The API process's registry: model name -> its service, built from the fleet config.

A service is whatever serves one model name: `GenerateService` for generate models (class
queues, router, replica set of engine processes), `EmbedService` and `CustomService` for
embed and custom models (a model and its dynamic batcher, serve/microbatch/services.py); another
kind plugs in through `register_kind`. The HTTP
handlers look a model up with `get(name, kind)`, which refuses an unknown name (404) and
a model of another kind than the endpoint serves (400), each naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from fleetserve.engine.embedding_result import MINILM_NAME
from fleetserve.metrics import ModelMetrics, ServerMetrics
from fleetserve.serve.config.fleet_config import FleetConfig, ModelEntry
from fleetserve.serve.microbatch.batcher import MicroBatchConfig
from fleetserve.serve.microbatch.services import CustomService, EmbedService
from fleetserve.serve.services.adapters import AdapterTable
from fleetserve.serve.services.generate import GenerateService


class ModelService(Protocol):
    """What the registry and the server's lifecycle need of every model's service."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str:
        """ "generate" | "embed" | "custom": which endpoints serve it."""
        ...

    @property
    def is_ready(self) -> bool:
        """It can take requests now (loaded, with a live replica)."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why it can never serve again (every replica is dead); None otherwise."""
        ...

    @property
    def crashed(self) -> bool:
        """An engine process exited without being asked to (the server exits non-zero)."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    async def start(self, timeout_s: float = 600.0) -> None: ...

    async def shutdown(self) -> None: ...

    def abort_all(self, reason: str) -> None: ...

    def card(self) -> dict[str, Any]:
        """Its entry in /v1/models beyond id/object/created/owned_by/kind."""
        ...

    def waiting_by_class(self) -> dict[str, int]:
        """Requests not started yet, per service class (the autoscaling signal)."""
        ...


ServiceBuilder = Callable[[ModelEntry, FleetConfig, ModelMetrics], ModelService]


class UnknownModelError(LookupError):
    pass


class WrongKindError(ValueError):
    pass


def _build_generate(entry: ModelEntry, fleet: FleetConfig, metrics: ModelMetrics) -> ModelService:
    return GenerateService(
        entry,
        fleet.service_classes(),
        fleet.default_class_name,
        spot_only_classes=fleet.spot_only_classes(),
        metrics=metrics,
    )


def _batching(entry: ModelEntry) -> MicroBatchConfig:
    b = entry.batching
    return MicroBatchConfig() if b is None else b


def _build_embed(entry: ModelEntry, fleet: FleetConfig, metrics: ModelMetrics) -> ModelService:
    return EmbedService(
        entry.name,
        entry.model or MINILM_NAME,
        batching=_batching(entry),
        on_batch=metrics.observe_batch,
    )


def _build_custom(entry: ModelEntry, fleet: FleetConfig, metrics: ModelMetrics) -> ModelService:
    assert entry.handler is not None  # the config's validator requires it for kind custom
    return CustomService(
        entry.name,
        entry.handler,
        options=entry.options,
        batching=_batching(entry),
        on_batch=metrics.observe_batch,
        **_handler_limits(entry),
    )


def _handler_limits(entry: ModelEntry) -> dict[str, Any]:
    """A custom model's timeout_s and memory_limit_mb, where the fleet file sets them."""
    limits: dict[str, Any] = {"memory_limit_mb": entry.memory_limit_mb}
    if entry.timeout_s is not None:
        limits["timeout_s"] = entry.timeout_s
    return limits


def _build_cascade(entry: ModelEntry, fleet: FleetConfig, metrics: ModelMetrics) -> ModelService:
    from fleetserve.serve.pipelines.cascade import CascadeService
    from fleetserve.serve.pipelines.rules import Rules

    assert entry.tiers is not None and entry.escalate is not None  # the config checked them
    return CascadeService(
        entry.name, entry.tiers, Rules(entry.escalate), entry.decide_after_tokens, metrics
    )


def _build_graph(entry: ModelEntry, fleet: FleetConfig, metrics: ModelMetrics) -> ModelService:
    from fleetserve.serve.pipelines.graph_check import terminal_kinds
    from fleetserve.serve.pipelines.graph_plan import plan_graph
    from fleetserve.serve.pipelines.graph_service import GraphService

    assert entry.graph is not None  # the config checked it
    kinds = {m.name: m.kind for m in fleet.models}
    plan = plan_graph(entry.name, entry.graph, kinds, terminal_kinds(entry.graph, kinds))
    return GraphService(plan, metrics)


_BUILDERS: dict[str, ServiceBuilder] = {
    "generate": _build_generate,
    "embed": _build_embed,
    "custom": _build_custom,
    "cascade": _build_cascade,
    "graph": _build_graph,
}


COMPOSITE_KINDS = ("cascade", "graph")


def build_composite(entry: ModelEntry, fleet: FleetConfig, metrics: ModelMetrics) -> ModelService:
    """A cascade's or a graph's service: it owns no engine, only calls the fleet's other
    models through whatever registry it is bound in (the local server's, or the Ray
    ingress's registry of deployment clients)."""
    if entry.kind not in COMPOSITE_KINDS:
        raise ValueError(f"kind {entry.kind!r} is not a composite kind ({COMPOSITE_KINDS})")
    return _BUILDERS[entry.kind](entry, fleet, metrics)


def register_kind(kind: str, builder: ServiceBuilder) -> None:
    """Lets a kind of model (embed, custom) be served: `builder` makes its service."""
    _BUILDERS[kind] = builder


class Registry:
    def __init__(self, services: list[ModelService]) -> None:
        self.services = {s.name: s for s in services}
        for s in services:  # a service built from others (a cascade) takes them now
            bind = getattr(s, "bind", None)
            if bind is not None:
                bind(self.services)
        self.created = int(time.time())

    def __iter__(self) -> Iterator[ModelService]:
        return iter(self.services.values())

    def get(self, name: str | None, kind: str) -> ModelService:
        """The service for `name` (None: the only model of `kind`, if there is one)."""
        if name is None:
            of_kind = [s for s in self if s.kind == kind]
            if len(of_kind) == 1:
                return of_kind[0]
            raise WrongKindError(f"model is required: this server has {self._listing()}")
        service = self.services.get(name)
        if service is None:
            service = self.adapter_owner(name)
        if service is None:
            raise UnknownModelError(
                f"the model {name!r} does not exist; this server has {self._listing()}"
            )
        if service.kind != kind:
            raise WrongKindError(
                f"the model {name!r} is a {service.kind} model; this endpoint serves {kind} models"
            )
        return service

    def adapter_owner(self, name: str) -> ModelService | None:
        """The generate model that serves the LoRA adapter `name`, if one does."""
        for s in self:
            adapters = getattr(s, "adapters", None)
            if isinstance(adapters, AdapterTable) and name in adapters:
                return s
        return None

    def _listing(self) -> str:
        return ", ".join(f"{s.name!r} ({s.kind})" for s in self)

    @property
    def is_ready(self) -> bool:
        return all(s.is_ready for s in self)

    @property
    def dead_reason(self) -> str | None:
        """Why some model can no longer serve (the server is then unhealthy), or None."""
        reasons = [f"{s.name}: {s.dead_reason}" for s in self if s.dead_reason is not None]
        return "; ".join(reasons) if reasons else None

    @property
    def crashed(self) -> bool:
        return any(s.crashed for s in self)

    @property
    def num_in_flight(self) -> int:
        return sum(s.num_in_flight for s in self)

    async def start(self, timeout_s: float = 600.0) -> None:
        """Starts every model in parallel; the first failure is raised, naming the model."""
        results = await asyncio.gather(*(s.start(timeout_s) for s in self), return_exceptions=True)
        for s, res in zip(self, results, strict=True):
            if isinstance(res, BaseException):
                raise RuntimeError(f"model {s.name!r}: {res}") from res

    async def shutdown(self) -> None:
        await asyncio.gather(*(s.shutdown() for s in self), return_exceptions=True)

    def abort_all(self, reason: str) -> None:
        for s in self:
            s.abort_all(reason)

    def cards(self) -> list[dict[str, Any]]:
        adapters = []
        for s in self:
            table = getattr(s, "adapters", None)
            if isinstance(table, AdapterTable):
                adapters.extend(table.cards(self.created))
        return [
            {
                "id": s.name,
                "object": "model",
                "created": self.created,
                "owned_by": "fleetserve",
                "kind": s.kind,
                **s.card(),
            }
            for s in self
        ] + adapters


def build_registry(fleet: FleetConfig, metrics: ServerMetrics) -> Registry:
    """Every model's service, built (configs and tokenizers loaded) but not started."""
    services = []
    for entry in fleet.models:
        builder = _BUILDERS.get(entry.kind)
        if builder is None:
            raise ValueError(
                f"models[{fleet.models.index(entry)}] ({entry.name}): kind {entry.kind!r} "
                "is not available in this build"
            )
        model_metrics = metrics.model(entry.name)
        model_metrics.declare(entry.kind, fleet.classes)
        try:
            services.append(builder(entry, fleet, model_metrics))
        except (OSError, ValueError) as e:
            raise ValueError(f"model {entry.name!r}: {e}") from e
    return Registry(services)
