"""The OpenAI ingress deployment: the local server's FastAPI app (same routes, errors,
auth, metrics, health) over a registry of clients of the model deployments (clients.py),
plus the fleet's cascades and graphs, which run here over those clients, and the
`fleet_call` its custom models' handlers reach the fleet through (fleet_client.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.handle import DeploymentHandle

from fleetserve.entrypoints.openai.access_log import ACCESS_LOG_MODES, configure_access_log
from fleetserve.entrypoints.openai.app_factory import ServerState, build_app
from fleetserve.entrypoints.openai.serving_common import ServingContext
from fleetserve.metrics import ServerMetrics
from fleetserve.ray.clients import RayGenerateClient
from fleetserve.ray.fleet_client import FleetCall, FleetReply, run_fleet_call, run_fleet_stream
from fleetserve.ray.microbatch_clients import RayCustomClient, RayEmbedClient
from fleetserve.ray.router_state import ROUTERS
from fleetserve.serve.config.fleet_config import parse_fleet_config
from fleetserve.serve.services.service_registry import (
    COMPOSITE_KINDS,
    ModelService,
    Registry,
    build_composite,
)


@dataclass(frozen=True)
class IngressOptions:
    """The local server's front-door settings (`fleetserve serve` flags)."""

    api_key: str | None = None
    max_request_bytes: int = 8 * 1024 * 1024
    request_read_timeout_s: float = 15.0
    drain_timeout_s: float = 30.0
    allowed_origins: tuple[str, ...] = ()
    # The access log (entrypoints/openai/access_log.py) goes to the ingress actor's
    # stdout, i.e. Ray's worker log files; "off" for none.
    access_log: str = "json"

    def __post_init__(self) -> None:
        if self.access_log not in ACCESS_LOG_MODES:
            modes = ", ".join(ACCESS_LOG_MODES)
            raise ValueError(f"access_log must be one of {modes}, got {self.access_log!r}")


class RayFleetCollector(Collector):
    """The local server's fleet series (serve/telemetry/fleet_metrics.py) on Ray: the queue depth
    `fleetserve:num_requests_waiting{model_name, class}` (the ingress's class queues), and
    per Serve replica of each generate model, as the ingress's router sees it (and as the
    replica last reported to it), `fleetserve:replica_*{model_name, replica}` (replica: its index, prefixed with its
    pool's name for a model with pools, e.g. "spot-0")."""

    def __init__(
        self, services: Sequence[ModelService], deployments: Sequence[tuple[str, str, str]]
    ) -> None:
        self.services = services
        self.deployments = deployments  # (model name, replica label prefix, deployment)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        queued = GaugeMetricFamily(
            "fleetserve:num_requests_waiting",
            "Requests not started yet: in their class queue at the ingress.",
            labels=["model_name", "class"],
        )
        for service in self.services:
            for name, n in service.waiting_by_class().items():
                queued.add_metric([service.name, name], n)
        yield queued
        labels = ["model_name", "replica"]
        tokens = GaugeMetricFamily(
            "fleetserve:replica_outstanding_tokens",
            "Prompt tokens not yet prefilled plus tokens still to generate, routed to it.",
            labels=labels,
        )
        requests = GaugeMetricFamily(
            "fleetserve:replica_outstanding_requests",
            "Requests routed to it and not finished.",
            labels=labels,
        )
        # The engine's own figures, as of the replica's last routing stats.
        waiting = GaugeMetricFamily(
            "fleetserve:replica_num_requests_waiting",
            "Requests waiting in its scheduler (as of its last routing stats).",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "fleetserve:replica_num_requests_running",
            "Requests its engine runs (as of its last routing stats).",
            labels=labels,
        )
        queried = CounterMetricFamily(
            "fleetserve:replica_prefix_cache_queries",
            "Prompt tokens looked up in its prefix cache (as of its last routing stats).",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "fleetserve:replica_prefix_cache_hits",
            "Prompt tokens found in its prefix cache (as of its last routing stats).",
            labels=labels,
        )
        for model, prefix, deployment in self.deployments:
            router = ROUTERS.get(deployment)
            if router is None:
                continue
            lora_metrics = next(
                (getattr(s, "lora_metrics", None) for s in self.services if s.name == model), None
            )
            for view in router.loads():
                lv = [model, f"{prefix}{view.index}"]
                stats = view.replica.routing_stats or {}
                if lora_metrics is not None and (
                    stats.get("lora_loads") or stats.get("lora_evictions")
                ):
                    # The replica's running totals -> counter increments (seen by this
                    # scrape's next one: the counters were collected before this collector).
                    lora_metrics.set_engine_totals(
                        hash((prefix, view.index)),
                        dict(stats.get("lora_loads") or {}),
                        dict(stats.get("lora_evictions") or {}),
                    )
                tokens.add_metric(lv, view.num_outstanding_tokens)
                requests.add_metric(lv, view.num_outstanding_requests)
                waiting.add_metric(lv, float(stats.get("num_requests_waiting", 0.0)))
                running.add_metric(lv, float(stats.get("num_requests_running", 0.0)))
                queried.add_metric(lv, float(stats.get("prefix_cache_queries", 0.0)))
                hits.add_metric(lv, float(stats.get("prefix_cache_hits", 0.0)))
        yield from (tokens, requests, waiting, running, queried, hits)


@serve.ingress()
class FleetIngress:
    def __init__(
        self,
        fleet: dict[str, Any],
        handles: dict[str, DeploymentHandle],
        max_ongoing: dict[str, int],
        options: IngressOptions,
        pool_handles: dict[str, dict[str, DeploymentHandle]] | None = None,
    ) -> None:
        """`handles`: each model's deployment, but for a generate model with pools, whose
        pools' deployments are in `pool_handles` (model -> pool name -> handle)."""
        config = parse_fleet_config(fleet, "fleet config")
        metrics = ServerMetrics()
        services: list[ModelService] = []
        pool_handles = pool_handles or {}
        generate: list[tuple[str, str, str]] = []
        for entry in config.models:
            # The batch sizes of embed/custom models are their replicas' (not exported here).
            metrics.model(entry.name).declare(entry.kind, config.classes, batches=False)
            if entry.kind in COMPOSITE_KINDS:  # no deployment: its steps/tiers are the clients here
                services.append(build_composite(entry, config, metrics.model(entry.name)))
                continue
            pools = pool_handles.get(entry.name)
            handle = None if pools is not None else handles[entry.name]
            if entry.kind == "generate":
                client = RayGenerateClient(
                    entry, config, handle, max_ongoing[entry.name], metrics.model(entry.name),
                    pools=pools,
                )  # fmt: skip
                services.append(client)
                generate += [
                    (entry.name, "" if pools is None else f"{route.pool}-", route.deployment)
                    for route in client.pools.routes
                ]
            elif entry.kind == "embed":
                services.append(RayEmbedClient(entry, handles[entry.name]))
            else:
                services.append(RayCustomClient(entry, handles[entry.name]))
        registry = Registry(services)
        metrics.registry.register(RayFleetCollector(services, generate))
        ctx = ServingContext(registry, options.max_request_bytes, options.request_read_timeout_s)
        configure_access_log(options.access_log)
        self.state = ServerState(ctx, metrics, options.api_key)
        # Serve's proxy sends its request id in and returns it as X-Request-Id itself.
        self._app = build_app(
            self.state,
            options.drain_timeout_s,
            options.allowed_origins,
            request_id_header=False,
        )

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def fleet_call(self, call: FleetCall) -> FleetReply:
        """A custom handler's sub-call (its replica's HandleFleetCall): run here, through
        the callee's client, in the parent's class and within its deadline."""
        return await run_fleet_call(self.state.ctx.registry, call)

    async def fleet_call_stream(
        self, call: FleetCall
    ) -> AsyncIterator[dict[str, Any] | FleetReply]:
        """A handler's streamed sub-call (HandleFleetCall with `emit`): the callee's
        chunks, then the closing FleetReply; cancelled by the caller, the callee's stream
        is closed and its engine requests aborted."""
        async for item in run_fleet_stream(self.state.ctx.registry, call):
            yield item
