"""The KEDA ScaledObject of one pool: pods follow the model's queue depth in Prometheus.

KEDA's Prometheus trigger is an `AverageValue` metric: the HPA asks for
ceil(queue depth / threshold) pods, so `threshold` is the waiting requests one pod may
have. `activationThreshold` decides 0 <-> 1 (the pool is active while the depth is above
it); with `minReplicaCount: 0` the pool scales to zero `cooldownPeriod` seconds after it
last was active. A missing series (no pod, or Prometheus has not scraped yet) counts as 0.
"""

from __future__ import annotations

from typing import Any

from fleetserve.serve.config.deploy_config import DeployConfig


def _number(value: float) -> str:
    """KEDA's trigger metadata is a map of strings; `8.0` -> "8", `0.5` -> "0.5"."""
    return f"{value:g}"


def scaled_object(
    name: str,
    namespace: str,
    labels: dict[str, str],
    deployment: str,
    deploy: DeployConfig,
    query: str,
    prometheus_url: str,
) -> dict[str, Any]:
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "pollingInterval": deploy.polling_interval_s,
            "cooldownPeriod": deploy.cooldown_s,
            "minReplicaCount": deploy.min_replicas,
            "maxReplicaCount": deploy.max_replicas,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": query,
                        "threshold": _number(deploy.target_queue_depth),
                        "activationThreshold": _number(deploy.activation_queue_depth),
                        "ignoreNullValues": "true",
                    },
                }
            ],
        },
    }
