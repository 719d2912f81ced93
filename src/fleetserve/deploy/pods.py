"""The Deployment of one model's pool: the fleetserve container, its probes and its drain.

Shutdown of a pod, and the budget `terminationGracePeriodSeconds` covers:

    delete -> preStop: sleep endpoint_delay_s      (the Service stops routing to the pod)
           -> SIGTERM: the server drains           (/ready 503; in-flight requests finish,
                       up to --drain-timeout        new ones get 503; then aborted)
           -> engine processes stop, exit 0        (SHUTDOWN_MARGIN_S)
           -> SIGKILL if still running at the grace period's end

Probes use the server's own paths: startup on /health (every model loaded; the budget
is startup_timeout_s, weights can take minutes), readiness on /ready (503 while loading or
draining: out of the Service at once), liveness on /live (the process answers; restart
only when it does not).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from fleetserve.deploy import scheduling
from fleetserve.serve.config.deploy_config import DeployConfig

CONFIG_DIR = "/etc/fleetserve"
CONFIG_FILE = "fleet.yaml"
CACHE_DIR = "/var/cache/fleetserve"
# Time for the engine processes to stop after the drain (they are told, then waited on).
SHUTDOWN_MARGIN_S = 15
STARTUP_PERIOD_S = 5


API_KEY_ENV = "FLEETSERVE_API_KEY"  # the server's key (server_args.api_key_from)
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")


def check_quantity(flag: str, value: str, cpu: bool) -> None:
    """A flag's CPU or memory quantity, checked as the fleet file's deploy section is."""
    try:
        DeployConfig(cpu=value) if cpu else DeployConfig(memory=value)
    except ValueError:
        raise ValueError(
            f"{flag} {value!r}: not a Kubernetes quantity (e.g. 2, 500m, 8Gi)"
        ) from None


@dataclass(frozen=True)
class SecretRef:
    """A key of a Secret that holds the API key (`--api-key-secret NAME[:KEY]`)."""

    name: str
    key: str = "api-key"

    def __post_init__(self) -> None:
        if not _SECRET_NAME.match(self.name):
            raise ValueError(f"--api-key-secret {self.name!r}: not a Kubernetes Secret name")
        if not _SECRET_KEY.match(self.key):
            raise ValueError(f"--api-key-secret {self.name}:{self.key}: not a Secret key")

    @classmethod
    def parse(cls, text: str) -> SecretRef:
        name, sep, key = text.partition(":")
        return cls(name, key) if sep else cls(name)

    def env(self) -> dict[str, Any]:
        """The container env entry that gives the server its key."""
        ref = {"name": self.name, "key": self.key}
        return {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}


@dataclass(frozen=True)
class PodSettings:
    image: str
    port: int
    config_map: str
    config_sha256: str  # a pod-template annotation: a changed fleet file rolls the pods
    api_key: SecretRef | None = None
    # A gateway has started and stays ready while some model has no pod (its /health and
    # /ready say 503 then; requests wait in its queues for a pod, and KEDA scales the pods
    # from zero on that queue); a model's pod is ready only when it can serve.
    readiness_path: str = "/ready"
    startup_path: str = "/health"


def grace_period_s(deploy: DeployConfig) -> int:
    return deploy.endpoint_delay_s + math.ceil(deploy.drain_timeout_s) + SHUTDOWN_MARGIN_S


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def container(deploy: DeployConfig, pod: PodSettings) -> dict[str, Any]:
    limits: dict[str, Any] = {"memory": deploy.memory}
    if deploy.gpu > 0:
        limits[scheduling.GPU_RESOURCE] = deploy.gpu
    drain = f"{deploy.drain_timeout_s:g}"
    out: dict[str, Any] = {
        "name": "fleetserve",
        "image": pod.image,
        "command": ["fleetserve"],
        "args": [
            "serve",
            "--config",
            f"{CONFIG_DIR}/{CONFIG_FILE}",
            "--host",
            "0.0.0.0",
            "--port",
            str(pod.port),
            "--drain-timeout",
            drain,
        ],  # fmt: skip
        "ports": [{"name": "http", "containerPort": pod.port, "protocol": "TCP"}],
        "env": [
            {"name": "FLEETSERVE_CACHE", "value": CACHE_DIR},
            *([pod.api_key.env()] if pod.api_key is not None else []),
        ],
        # CPU is requested, not limited: a throttled engine step is a latency spike.
        "resources": {"requests": {"cpu": deploy.cpu, "memory": deploy.memory}, "limits": limits},
        "startupProbe": _probe(
            pod.startup_path,
            STARTUP_PERIOD_S,
            math.ceil(deploy.startup_timeout_s / STARTUP_PERIOD_S),
        ),
        "readinessProbe": _probe(pod.readiness_path, 5, 1),
        "livenessProbe": _probe("/live", 10, 3),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if deploy.endpoint_delay_s > 0:
        out["lifecycle"] = {
            "preStop": {"exec": {"command": ["sleep", str(deploy.endpoint_delay_s)]}}
        }
    return out


def deployment(
    name: str,
    namespace: str,
    labels: dict[str, str],
    selector: dict[str, str],
    deploy: DeployConfig,
    pod: PodSettings,
) -> dict[str, Any]:
    """No `replicas`: KEDA's HPA owns the count, and `kubectl apply` must not reset it."""
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace_period_s(deploy),
        "affinity": scheduling.node_affinity(deploy.pool),
        "containers": [container(deploy, pod)],
        "volumes": [
            {"name": "config", "configMap": {"name": pod.config_map}},
            {"name": "cache", "emptyDir": {}},
            # torch's worker processes share tensors through /dev/shm (64 MiB by default).
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
        ],
    }
    tolerations = scheduling.tolerations(deploy.pool, deploy.gpu)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": selector},
            # A new pod is ready before an old one drains: capacity never dips in a rollout.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {"fleetserve/config-sha256": pod.config_sha256},
                },
                "spec": pod_spec,
            },
        },
    }
