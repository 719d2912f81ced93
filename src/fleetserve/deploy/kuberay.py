"""`fleetserve deploy k8s --ray`: the fleet as a KubeRay RayService running Fleet II's app.

    RayService fleetserve (ray.io/v1; KubeRay makes the RayCluster and fleetserve-serve-svc)
      serveConfigV2: one application, import_path fleetserve.ray.app:build_app_from_args,
                     args = the fleet file (each model placed on its own worker group)
      head group:    on-demand nodes, no CPUs for replicas (the ingress takes 0 CPUs)
      worker group per model: pods sized by its `deploy:`, spot or on-demand nodes as
                     deploy.pool says, min..max pods; Ray's autoscaler adds pods as Serve
                     adds replicas

A worker pod of model M offers Ray the custom resource `fleetserve-M` = M's `replicas`
(engines per pod, as in a Deployment's pod) and its CPUs; each Serve replica of M takes
one `fleetserve-M` and its share of the CPUs, so M's replicas land only on M's pods. Serve
autoscales M between deploy.min_replicas and deploy.max_replicas pods' worth of replicas
on the queue depth (`autoscale:`, ray/autoscale.py), with deploy.target_queue_depth per pod.
A model with `pools:` gets a worker group per capacity instead (deploy/kuberay_pools.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from fleetserve.deploy import kuberay_pools, pods, scheduling
from fleetserve.deploy.yaml_out import dump_yaml
from fleetserve.serve.config.deploy_config import DeployConfig
from fleetserve.serve.config.fleet_config import FleetConfig, ModelEntry, parse_fleet_config

RAY_SERVICE_NAME = "fleetserve"
APP_NAME = "fleetserve"  # ray/serve_cli.py's name for the application
IMPORT_PATH = "fleetserve.ray.app:build_app_from_args"
RAY_VERSION = "2.60.0"  # the Ray that fleetserve[ray] installed when this was written
SERVE_PORT = 8000  # Serve's HTTP proxy; KubeRay's fleetserve-serve-svc points at it
HEAD_LABELS = {"app.kubernetes.io/name": "fleetserve", "app.kubernetes.io/component": "ray-head"}
METRICS_SERVICE = "fleetserve-ray-metrics"
_QUANTITY = re.compile(r"^([0-9.]+)([A-Za-z]*)$")
_QUANTITY_SCALE = {"m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                   "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                   "Pi": 2**50, "Ei": 2**60}  # fmt: skip


@dataclass(frozen=True)
class RaySettings:
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    version: str = RAY_VERSION

    def __post_init__(self) -> None:
        pods.check_quantity("--ray-head-cpu", self.head_cpu, cpu=True)
        pods.check_quantity("--ray-head-memory", self.head_memory, cpu=False)
        parts = self.version.split(".")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--ray-version {self.version!r}: expected X.Y.Z")


def whole_cpus(cpu: str) -> int:
    """A CPU quantity as the whole CPUs KubeRay gives Ray (it rounds up: 500m -> 1)."""
    match = _QUANTITY.match(cpu)
    assert match is not None and match[2] in _QUANTITY_SCALE, cpu  # DeployConfig checked it
    return max(1, math.ceil(float(match[1]) * _QUANTITY_SCALE[match[2]]))


def _resource(slug: str) -> str:
    return f"fleetserve-{slug}"


def ray_model_entry(index: int, entry: ModelEntry, written: dict[str, Any], slug: str) -> dict:
    """One model of the Ray fleet file: as written, minus `deploy` and `replicas`, plus the
    `placement` and `autoscale` its deploy section implies."""
    for key in ("autoscale", "placement"):
        if key in written:
            raise ValueError(
                f"models[{index}].{key} (model {entry.name!r}): `deploy k8s --ray` derives "
                "it from the model's deploy section (one worker group per model); leave it out"
            )
    deploy = entry.deploy or DeployConfig()
    out = {k: v for k, v in written.items() if k not in ("deploy", "replicas")}
    if entry.pools is not None:  # PoolPolicy sizes the pools' deployments
        kuberay_pools.check_deploy(index, entry)
        out["placement"] = kuberay_pools.pools_placement(
            entry, _resource(slug), whole_cpus(deploy.cpu)
        )
        return out
    per_pod = entry.replicas
    out["placement"] = {
        "num_cpus": whole_cpus(deploy.cpu) / per_pod,
        "resources": {_resource(slug): 1.0},
    }
    out["autoscale"] = {
        "min_replicas": deploy.min_replicas * per_pod,
        "max_replicas": deploy.max_replicas * per_pod,
        "target_queue_depth": deploy.target_queue_depth / per_pod,
    }
    return out


def ray_fleet_file(fleet: FleetConfig, slugs: dict[str, str]) -> dict[str, Any]:
    data = fleet.model_dump(mode="json", exclude_unset=True)
    models = [
        ray_model_entry(i, entry, written, slugs[entry.name])
        for i, (entry, written) in enumerate(zip(fleet.models, data["models"], strict=True))
    ]
    out: dict[str, Any] = {"models": models}
    for key in ("classes", "default_class"):
        if key in data:
            out[key] = data[key]
    parse_fleet_config(out, "the RayService's fleet file")  # still a valid fleet
    return out


def serve_config(fleet_file: dict[str, Any]) -> dict[str, Any]:
    """Serve's config file (ray.serve.schema.ServeDeploySchema) for the fleet."""
    app = {"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH, "args": fleet_file}
    return {"applications": [app]}


def _container(
    name: str, image: str, deploy: DeployConfig, api_key: pods.SecretRef | None
) -> dict[str, Any]:
    """A Ray container; KubeRay writes its command (`ray start ...`)."""
    limits: dict[str, Any] = {"memory": deploy.memory}
    if deploy.gpu > 0:
        limits[scheduling.GPU_RESOURCE] = deploy.gpu
    env = [{"name": "FLEETSERVE_CACHE", "value": pods.CACHE_DIR}]
    if api_key is not None:
        env.append(api_key.env())
    return {
        "name": name,
        "image": image,
        "env": env,
        "resources": {"requests": {"cpu": deploy.cpu, "memory": deploy.memory}, "limits": limits},
        "volumeMounts": [
            {"name": "cache", "mountPath": pods.CACHE_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _pod_template(
    labels: dict[str, str], container: dict[str, Any], deploy: DeployConfig
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "affinity": scheduling.node_affinity(deploy.pool),
        "containers": [container],
        "volumes": [
            {"name": "cache", "emptyDir": {}},
            # Ray's object store lives in /dev/shm.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    tolerations = scheduling.tolerations(deploy.pool, deploy.gpu)
    if tolerations:
        spec["tolerations"] = tolerations
    return {"metadata": {"labels": labels}, "spec": spec}


def worker_groups(
    entry: ModelEntry, slug: str, image: str, api_key: pods.SecretRef | None
) -> list[dict[str, Any]]:
    """The model's worker group, or with pools one per capacity (kuberay_pools)."""
    deploy = entry.deploy or DeployConfig()
    cpus = whole_cpus(deploy.cpu)
    if entry.pools is None:
        resources = {"CPU": str(cpus), _resource(slug): str(entry.replicas)}
        if deploy.gpu > 0:
            resources["GPU"] = str(deploy.gpu)
        return [_group(slug, slug, deploy, resources, deploy.min_replicas,
                       deploy.max_replicas, image, api_key)]  # fmt: skip
    out = []
    for group in kuberay_pools.capacity_groups(entry):
        # Its nodes as `deploy: {pool: ...}` would place a pod of that capacity.
        placed = deploy.model_copy(update={"pool": group.capacity})
        resources = kuberay_pools.group_resources(group, _resource(slug), deploy, cpus)
        out.append(_group(group.group_name(slug), slug, placed, resources, group.min_pods,
                          group.max_pods, image, api_key))  # fmt: skip
    return out


def _group(
    name: str,
    slug: str,
    deploy: DeployConfig,
    resources: dict[str, str],
    min_pods: int,
    max_pods: int,
    image: str,
    api_key: pods.SecretRef | None,
) -> dict[str, Any]:
    labels = {
        "app.kubernetes.io/name": "fleetserve",
        "app.kubernetes.io/component": "ray-worker",
        "fleetserve/model": slug,
        "fleetserve/pool": deploy.pool,
    }
    return {
        "groupName": name,
        "replicas": min_pods,
        "minReplicas": min_pods,
        "maxReplicas": max_pods,
        "rayStartParams": {},
        "resources": resources,
        "template": _pod_template(labels, _container("ray-worker", image, deploy, api_key), deploy),
    }


def ray_service(
    fleet: FleetConfig,
    settings: RaySettings,
    slugs: dict[str, str],
    namespace: str,
    image: str,
    api_key: pods.SecretRef | None,
) -> dict[str, Any]:
    fleet_file = ray_fleet_file(fleet, slugs)
    head = DeployConfig(cpu=settings.head_cpu, memory=settings.head_memory)
    head_container = _container("ray-head", image, head, api_key)
    head_container["ports"] = [
        {"name": "gcs", "containerPort": 6379, "protocol": "TCP"},
        {"name": "dashboard", "containerPort": 8265, "protocol": "TCP"},
        {"name": "client", "containerPort": 10001, "protocol": "TCP"},
        {"name": "serve", "containerPort": SERVE_PORT, "protocol": "TCP"},
    ]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {
            "name": RAY_SERVICE_NAME,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "fleetserve"},
        },
        "spec": {
            "serveConfigV2": dump_yaml(serve_config(fleet_file)),
            "rayClusterConfig": {
                "rayVersion": settings.version,
                "enableInTreeAutoscaling": True,
                "headGroupSpec": {
                    "rayStartParams": {"dashboard-host": "0.0.0.0"},
                    # No replica on the head: it holds the cluster's state, on-demand.
                    "resources": {"CPU": "0", **kuberay_pools.head_resources(fleet.models)},
                    "template": _pod_template(dict(HEAD_LABELS), head_container, head),
                },
                "workerGroupSpecs": [
                    group
                    for entry in fleet.models
                    for group in worker_groups(entry, slugs[entry.name], image, api_key)
                ],
            },
        },
    }


def metrics_service(namespace: str, service_label: str) -> dict[str, Any]:
    """A headless Service of the head pod's Serve proxy, for the ServiceMonitor: the
    ingress answers /metrics there (the class queues' depth, latencies, the replicas'
    figures). Ours rather than KubeRay's serve Service, whose labels are KubeRay's."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": METRICS_SERVICE,
            "namespace": namespace,
            "labels": {**HEAD_LABELS, service_label: "ray"},
        },
        "spec": {
            "clusterIP": "None",
            "selector": dict(HEAD_LABELS),
            "ports": [
                {"name": "http", "port": SERVE_PORT, "targetPort": "serve", "protocol": "TCP"}
            ],  # fmt: skip
        },
    }
