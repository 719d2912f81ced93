"""`deploy k8s --ray` for a generate model with `pools:` (spot and on-demand capacity).

On Ray, each pool is a Serve deployment whose replicas ask for a sliver of the pool's
capacity resource (`placement.spot_resource`, `on_demand_resource`: ray/pool_deployments.py), and
PoolPolicy sizes them, falling back to on-demand while spot replicas cannot be placed. On
KubeRay the nodes that offer those resources are worker pods, so the model gets one
worker group per capacity:

    worker group M-spot       spot nodes (the providers' spot labels and taints, as
                              `deploy: {pool: spot}` renders them for pods); Ray resources
                              CPU, fleetserve-M: 1, spot: 1; pods: the spot pools' sizes
    worker group M-on-demand  on-demand nodes; fleetserve-M: 1, on_demand: 1; pods from
                              the on-demand pools' base up to base + max_fallback

A pod runs one replica (the deploy section's cpu, memory and gpu are its size), so a
group's pods span its pools' fewest..most replicas, and Ray's autoscaler adds a pod when
Serve has a replica it cannot place. A replica asks for its model's resource and its
pool's capacity resource, which only its own group offers. A spot pod that the cloud
cannot start stays Pending: its replica is not placed, and after spot_pending_s the
on-demand pool falls back (a pod of the on-demand group). The head offers the on-demand
resource too: the ingress asks for it (it must not sit on a spot node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fleetserve.serve.config.deploy_config import DeployConfig
from fleetserve.serve.config.fleet_config import ModelEntry, PlacementConfig
from fleetserve.serve.replicas.pool_plan import pool_size

# What a pod of a capacity group offers of its capacity resource; a replica asks 0.001
# (ray/pool_deployments.py), so the pod's CPUs, not this, bound how many it runs.
CAPACITY_UNITS = "1"
# The deploy keys that pools decide instead (refused rather than ignored).
_POOL_DECIDED = ("pool", "min_replicas", "max_replicas", "target_queue_depth")
_DEFAULT_PLACEMENT = PlacementConfig()


@dataclass(frozen=True)
class CapacityGroup:
    """The worker group of one capacity of a model's pools."""

    capacity: Literal["spot", "on_demand"]
    min_pods: int
    max_pods: int

    @property
    def resource(self) -> str:
        place = _DEFAULT_PLACEMENT
        return place.spot_resource if self.capacity == "spot" else place.on_demand_resource

    def group_name(self, slug: str) -> str:
        return f"{slug}-{self.capacity.replace('_', '-')}"


def check_deploy(index: int, entry: ModelEntry) -> None:
    """A pools model's deploy section sizes its pods only; where pods run and how many is
    its pools' to say."""
    given = sorted(set(_POOL_DECIDED) & (entry.deploy.model_fields_set if entry.deploy else set()))
    if given:
        raise ValueError(
            f"models[{index}].deploy.{given[0]} (model {entry.name!r}): with pools, each "
            "pool's capacity and size place and count its pods (a worker group per "
            "capacity); leave it out"
        )


def capacity_groups(entry: ModelEntry) -> list[CapacityGroup]:
    """One group per capacity that may run a replica, on-demand first."""
    groups = []
    for capacity in ("on_demand", "spot"):
        sizes = [pool_size(p) for p in entry.pools or [] if p.capacity == capacity]
        most = sum(high for _, high in sizes)
        if most > 0:
            groups.append(CapacityGroup(capacity, sum(low for low, _ in sizes), most))  # type: ignore[arg-type]
    return groups


def pools_placement(entry: ModelEntry, own_resource: str, cpus: int) -> dict[str, Any]:
    """The model's `placement` in the Ray fleet file: a pod's CPUs and the model's own
    resource per replica; the capacity resources' names, which its groups offer."""
    place = _DEFAULT_PLACEMENT
    return {
        "num_cpus": float(cpus),
        "resources": {own_resource: 1.0},
        "spot_resource": place.spot_resource,
        "on_demand_resource": place.on_demand_resource,
    }


def group_resources(
    group: CapacityGroup, own_resource: str, deploy: DeployConfig, cpus: int
) -> dict[str, str]:
    resources = {
        "CPU": str(cpus),
        own_resource: "1",  # one replica per pod
        group.resource: CAPACITY_UNITS,
    }
    if deploy.gpu > 0:
        resources["GPU"] = str(deploy.gpu)
    return resources


def head_resources(entries: list[ModelEntry]) -> dict[str, str]:
    """What the head offers besides its 0 CPUs: the on-demand resource where some model
    has pools (the ingress asks for a sliver of it: ray/app.py)."""
    if any(e.pools for e in entries):
        return {_DEFAULT_PLACEMENT.on_demand_resource: CAPACITY_UNITS}
    return {}
