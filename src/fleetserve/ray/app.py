"""`build_app(config)`: the fleet file as a Ray Serve application.

    FleetIngress (OpenAI routes; class queues)  --handle-->  one deployment per model
        generate: GenerateReplica (one engine per Serve replica), routed by
                  FleetRequestRouter with the model's `routing` policy
        embed / custom: MicroBatchReplica (the service and its dynamic batcher); a
                  custom handler's fleet client calls back into the ingress's
                  `fleet_call` through its handle (fleet_client.py)
        cascade / graph: no deployment; the ingress serves them over its clients

Per model: `replicas`, or `autoscale` (queue depth, autoscale.py); `placement` gives each
replica's Ray resources (`num_cpus`, `memory_gb`, custom `resources`, which is how a pool
is pinned to labelled nodes) and `max_replicas_per_node` (1 spreads replicas over nodes).
A generate model with `pools` is one deployment per pool, on nodes with the pool's custom
resource, sized by the pools' policy (pools.py); the ingress then runs on on-demand capacity.
A replica takes `max_ongoing_requests = seats + 2 * target_queue_depth` requests at once
(seats: `max_num_seqs`, or the batcher's `max_batch_size`), so that the queue the
autoscaler reads can grow past its target before the ingress holds requests back.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve import Application

from fleetserve.entrypoints.openai.server_args import api_key_from
from fleetserve.ray.autoscale import QueueDepthPolicy
from fleetserve.ray.deployments import GenerateReplica, MicroBatchReplica
from fleetserve.ray.fleet_client import INGRESS_DEPLOYMENT
from fleetserve.ray.ingress import FleetIngress, IngressOptions
from fleetserve.ray.pool_deployments import (
    capacity_placement,
    deployment_name,
    pool_options,
    served_pools,
)
from fleetserve.ray.request_router import FleetRequestRouter
from fleetserve.serve.config.fleet_config import (
    AutoscaleConfig,
    FleetConfig,
    ModelEntry,
    PlacementConfig,
    PoolConfig,
    load_fleet_config,
    parse_fleet_config,
)
from fleetserve.serve.services.service_registry import COMPOSITE_KINDS

DEFAULT_TARGET_QUEUE_DEPTH = AutoscaleConfig().target_queue_depth
# How often replicas report load (routing stats, autoscaling metrics): seconds, not Serve's
# default 10 s, since step latency and queue depth move that fast.
STATS_PERIOD_S = 1.0


def _fleet(config: str | dict[str, Any] | FleetConfig) -> FleetConfig:
    if isinstance(config, FleetConfig):
        return config
    if isinstance(config, str):
        return load_fleet_config(config)
    return parse_fleet_config(config)


def model_options(entry: ModelEntry) -> tuple[dict[str, Any], int]:
    """Serve deployment options for one model, and the seats of one replica."""
    if entry.kind == "generate":
        config, _ = entry.engine_args().resolve()
        seats = config.scheduler.max_num_seqs
        block_size = config.cache.block_size
    else:
        seats = entry.batching.max_batch_size if entry.batching else 32
        block_size = 16
    auto = entry.autoscale
    target = auto.target_queue_depth if auto else DEFAULT_TARGET_QUEUE_DEPTH
    place = entry.placement
    actor: dict[str, Any] = {"num_cpus": place.num_cpus if place else 1.0}
    if place is not None and place.memory_gb is not None:
        actor["memory"] = int(place.memory_gb * 2**30)
    if place is not None and place.resources:
        actor["resources"] = dict(place.resources)
    opts: dict[str, Any] = {
        "name": deployment_name(entry.name),
        "max_ongoing_requests": seats + math.ceil(2 * target),
        "ray_actor_options": actor,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 10.0,
    }
    if place is not None and place.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = place.max_replicas_per_node
    if auto is None:
        opts["num_replicas"] = entry.replicas
    else:
        opts["autoscaling_config"] = {
            "min_replicas": auto.min_replicas,
            "initial_replicas": auto.min_replicas,
            "max_replicas": auto.max_replicas,
            "upscale_delay_s": auto.upscale_delay_s,
            "downscale_delay_s": auto.downscale_delay_s,
            "metrics_interval_s": STATS_PERIOD_S,
            "look_back_period_s": 2 * STATS_PERIOD_S,
            "policy": {
                "policy_function": QueueDepthPolicy,
                "policy_kwargs": {"seats_per_replica": seats, "target_queue_depth": target},
            },
        }
    if entry.kind == "generate":
        opts["request_router_config"] = {
            "request_router_class": FleetRequestRouter,
            "request_router_kwargs": {
                "policy": entry.routing,
                "block_size": block_size,
                "seed": entry.engine_args().seed or 0,
            },
            "request_routing_stats_period_s": STATS_PERIOD_S,
        }
    return opts, seats


def ingress_actor_options(fleet: FleetConfig) -> dict[str, Any]:
    """The ingress's Ray options: no CPUs (it waits on the replicas), and, where a model
    has pools, a place on on-demand capacity: it holds every request's stream, and a
    preempted spot node must not take it (and them) along."""
    opts: dict[str, Any] = {"num_cpus": 0}
    for entry in fleet.models:
        if entry.pools is not None:
            opts.update(capacity_placement(entry.placement or PlacementConfig(), spot=False))
            break
    return opts


def _notice(pool: PoolConfig) -> dict[str, Any] | None:
    """A spot pool's cloud notice config, for its replicas' engines to watch."""
    return dataclasses.asdict(pool.notice) if pool.notice is not None else None


def build_app(
    config: str | dict[str, Any] | FleetConfig, options: IngressOptions | None = None
) -> Application:
    """The fleet (a fleet YAML path, its parsed dict, or a FleetConfig) as a Serve
    application; ValueError naming the key for a bad file, before anything starts."""
    fleet = _fleet(config)
    handles: dict[str, Any] = {}
    pool_handles: dict[str, dict[str, Any]] = {}  # model -> pool -> its deployment
    max_ongoing: dict[str, int] = {}
    for entry in fleet.models:
        if entry.kind in COMPOSITE_KINDS:  # served by the ingress itself (ray/fleet_client.py)
            continue
        opts, _ = model_options(entry)
        max_ongoing[entry.name] = opts["max_ongoing_requests"]
        if entry.kind == "generate":
            args = entry.engine_args()
            if args.num_threads is None:
                # One engine per replica: its thread budget is the CPUs Ray gives it.
                num_cpus = opts["ray_actor_options"]["num_cpus"]
                args = replace(args, num_threads=max(1, int(num_cpus)))
            if entry.pools is not None:
                pool_handles[entry.name] = {
                    pool.name: serve.deployment(**pool_options(entry, pool, opts, STATS_PERIOD_S))(
                        GenerateReplica
                    ).bind(entry.name, args, entry.resilience, _notice(pool))
                    for pool in served_pools(entry)
                }
                continue
            deployment = serve.deployment(**opts)(GenerateReplica)
            handles[entry.name] = deployment.bind(entry.name, args, entry.resilience)
        else:
            deployment = serve.deployment(**opts)(MicroBatchReplica)
            handles[entry.name] = deployment.bind(entry.model_dump(), INGRESS_DEPLOYMENT)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        # The ingress holds the class queues; the model deployments bound the work.
        max_ongoing_requests=100_000,
        ray_actor_options=ingress_actor_options(fleet),
    )(FleetIngress)
    # Only what the file said: re-validated in the ingress, defaults must not read as given.
    fleet_data = fleet.model_dump(exclude_unset=True)
    return ingress.bind(fleet_data, handles, max_ongoing, options or IngressOptions(), pool_handles)


def build_app_from_args(args: dict[str, Any]) -> Application:
    """The fleet as Serve's config file runs it (KubeRay's `serveConfigV2`, `serve deploy`):
    `import_path: fleetserve.ray.app:build_app_from_args` with the fleet file as `args`.
    Serve calls an application builder with one argument, the `args` mapping, so the
    front-door settings are `fleetserve serve`'s defaults, and the API key comes from
    $FLEETSERVE_API_KEY on the node that builds the application (unset: no key)."""
    return build_app(dict(args), IngressOptions(api_key=api_key_from(None, os.environ)))
