"""The gateway of `fleetserve deploy k8s --gateway`: one endpoint over every model's pods.

    clients --> Service fleetserve-gateway (port 80)
                  --> gateway pods: `fleetserve serve --config` on the gateway fleet file
                        model M: remote: {dns: fleetserve-M-pods.NS.svc:PORT}
                  --> headless Service fleetserve-M-pods --> M's ready pods

The gateway fleet file is the fleet file with each generate model's engines replaced by
`remote:` (serve/remote/targets.py re-resolves the headless Service, so pods that KEDA adds
or removes join and leave): one endpoint routes over the pods with the model's `routing`
(prefix affinity), the fleet's classes, and moves requests off pods that die or drain.
The gateway tokenizes, so `model` and `engine` stay (its image needs the model files).
Embed and custom models cannot be remote; they stay at their own Services.

Scale to zero: a model with `deploy.min_replicas: 0` may have no pod. The gateway starts
and serves without one; a request for it waits in the gateway's class queue (up to the
model's `resilience.migration_wait_s`, or its class's `max_queue_time_s`) and is counted in
the gateway's `fleetserve:num_requests_waiting{model_name}`, which the ServiceMonitor
scrapes and the model's ScaledObject sums: KEDA activates the Deployment, the pod turns
ready, the headless Service lists it, the gateway's next DNS refresh adds it, and the
request is sent there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from fleetserve.deploy import pods
from fleetserve.deploy.yaml_out import dump_yaml
from fleetserve.serve.config.deploy_config import DeployConfig
from fleetserve.serve.config.fleet_config import (
    POD_RESILIENCE_KEYS,
    FleetConfig,
    parse_fleet_config,
)

GATEWAY_NAME = "fleetserve-gateway"
# What a gateway entry keeps: how to tokenize, route and survive; the replicas are remote.
_KEPT_KEYS = ("name", "kind", "model", "routing", "engine", "resilience")


@dataclass(frozen=True)
class GatewaySettings:
    replicas: int = 2
    cpu: str = "2"
    memory: str = "4Gi"

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 100:
            raise ValueError(f"--gateway-replicas {self.replicas}: 1..100")
        pods.check_quantity("--gateway-cpu", self.cpu, cpu=True)
        pods.check_quantity("--gateway-memory", self.memory, cpu=False)


def pods_dns(slug: str, namespace: str, port: int) -> str:
    """The headless Service of a model's pods, as `remote.dns` names it."""
    return f"fleetserve-{slug}-pods.{namespace}.svc:{port}"


def check_fleet(fleet: FleetConfig) -> None:
    """What the gateway cannot do, refused with the key's path."""
    if not any(m.kind == "generate" for m in fleet.models):
        raise ValueError("--gateway: the fleet has no generate model to route")


def gateway_fleet_file(
    fleet: FleetConfig, slugs: dict[str, str], namespace: str, port: int, api_key: bool
) -> dict[str, Any]:
    """The gateway's fleet file: each generate model as the user wrote it (unset fields
    stay unset) minus its replicas and deploy section, plus `remote` on its pods."""
    data = fleet.model_dump(mode="json", exclude_unset=True)
    models = []
    for entry, written in zip(fleet.models, data["models"], strict=True):
        if entry.kind != "generate":
            continue
        model = {k: v for k, v in written.items() if k in _KEPT_KEYS}
        if "resilience" in model:
            # The pods' own engines' settings stay with the pods (the gateway refuses them).
            kept = {k: v for k, v in model["resilience"].items() if k not in POD_RESILIENCE_KEYS}
            model["resilience"] = kept
        remote: dict[str, Any] = {"dns": pods_dns(slugs[entry.name], namespace, port)}
        if api_key:
            # The pods take the same key as the gateway (one Secret).
            remote["api_key_env"] = pods.API_KEY_ENV
        models.append({**model, "remote": remote})
    out: dict[str, Any] = {"models": models}
    for key in ("classes", "default_class"):
        if key in data:
            out[key] = data[key]
    parse_fleet_config(out, "the gateway's fleet file")  # still a valid fleet
    return out


def render_gateway(
    fleet: FleetConfig,
    settings: GatewaySettings,
    slugs: dict[str, str],
    namespace: str,
    image: str,
    port: int,
    api_key: pods.SecretRef | None,
) -> dict[str, dict[str, Any]]:
    """kind -> object: the gateway's ConfigMap, Deployment, Service and PDB."""
    check_fleet(fleet)
    name = GATEWAY_NAME
    selector = {"app.kubernetes.io/name": "fleetserve", "app.kubernetes.io/instance": name}
    labels = {**selector, "app.kubernetes.io/component": "gateway"}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    fleet_yaml = dump_yaml(gateway_fleet_file(fleet, slugs, namespace, port, api_key is not None))
    # Started once it answers (tokenizers load before the port is bound): it does not
    # wait for pods, which may be at zero.
    deploy = DeployConfig(cpu=settings.cpu, memory=settings.memory)
    pod = pods.PodSettings(
        image=image,
        port=port,
        config_map=f"{name}-config",
        config_sha256=hashlib.sha256(fleet_yaml.encode()).hexdigest(),
        api_key=api_key,
        readiness_path="/live",
        startup_path="/live",
    )
    deployment = pods.deployment(name, namespace, labels, selector, deploy, pod)
    # Not scaled by KEDA: the gateway's own count. Its pods are on-demand nodes (a gateway
    # that is preempted cuts every stream through it).
    deployment["spec"] = {"replicas": settings.replicas, **deployment["spec"]}
    service_labels = {**labels, "fleetserve/service": "gateway"}
    return {
        "configmap": {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {**meta, "name": f"{name}-config"},
            "data": {pods.CONFIG_FILE: fleet_yaml},
        },
        "deployment": deployment,
        "service": {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {**meta, "labels": service_labels},
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
            },
        },
        "pdb": {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
        },
    }
