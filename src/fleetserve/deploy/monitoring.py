"""How Prometheus sees the pods: the ServiceMonitor, the labels its scrape puts on every
series, the queue-depth query KEDA runs, and the plain scrape config the ServiceMonitor
implies (what the Prometheus operator would generate, for a Prometheus without it).

The Prometheus operator labels each scraped series with the target's `namespace`,
`service`, `pod`, `container`, `endpoint` and `job` (the Service's name), and copies the
pod labels named in `podTargetLabels` with their names sanitized (`fleetserve/pool` ->
`fleetserve_pool`). The server itself labels its series with `model_name` (and `class`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MODEL_LABEL = "fleetserve/model"
POOL_LABEL = "fleetserve/pool"
SERVICE_LABEL = "fleetserve/service"
POD_TARGET_LABELS = (MODEL_LABEL, POOL_LABEL)
METRICS_PORT_NAME = "http"
METRICS_PATH = "/metrics"


def prometheus_label(k8s_label: str) -> str:
    """A Kubernetes label key as the Prometheus operator names it on a series."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", k8s_label)


def promql_string(value: str) -> str:
    """A PromQL string literal (Go's double-quoted syntax)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def queue_depth_query(namespace: str, model_name: str) -> str:
    """Requests waiting for one model, summed over its pods: the autoscaling signal."""
    matchers = f"namespace={promql_string(namespace)},model_name={promql_string(model_name)}"
    return f"sum(fleetserve:num_requests_waiting{{{matchers}}})"


def service_monitor(
    name: str,
    namespace: str,
    selector: Mapping[str, str],
    labels: Mapping[str, str] | None = None,
    interval_s: int = 15,
    services: Sequence[str] = (),
    api_key: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """`services`: values of the Services' `fleetserve/service` label to scrape besides
    those `selector` matches (the gateway: a model's queue is there while no pod is).
    `api_key`: (Secret name, key) of the servers' API key, which /metrics requires: the
    scrape sends it as a bearer token (without it every target answers 401, and the
    queue depth KEDA scales on never reaches Prometheus)."""
    match: dict[str, Any] = {"matchLabels": dict(selector)}
    if services:
        match["matchExpressions"] = [
            {"key": SERVICE_LABEL, "operator": "In", "values": list(services)}
        ]
    endpoint: dict[str, Any] = {
        "port": METRICS_PORT_NAME,
        "path": METRICS_PATH,
        "interval": f"{interval_s}s",
    }
    if api_key is not None:
        secret, key = api_key
        endpoint["authorization"] = {"type": "Bearer",
                                     "credentials": {"name": secret, "key": key}}  # fmt: skip
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "fleetserve", **(labels or {})},
        },
        "spec": {
            "selector": match,
            "namespaceSelector": {"matchNames": [namespace]},
            "podTargetLabels": list(POD_TARGET_LABELS),
            "endpoints": [endpoint],
        },
    }


@dataclass(frozen=True)
class ScrapeTarget:
    """One pod as a Prometheus target: `address` is host:port of its metrics port."""

    address: str
    pod_name: str
    service: str
    pod_labels: Mapping[str, str]


def implied_scrape_config(
    monitor: Mapping[str, Any],
    targets: Sequence[ScrapeTarget],
    interval: str | None = None,
    secrets: Mapping[tuple[str, str], str] | None = None,
) -> dict[str, Any]:
    """The scrape job the operator derives from `monitor`, with static targets instead of
    Kubernetes discovery. `interval` overrides the endpoint's (tests scrape every second);
    `secrets` holds the values of the Secret keys the endpoint names, by (name, key)."""
    spec = monitor["spec"]
    (endpoint,) = spec["endpoints"]
    namespace = monitor["metadata"]["namespace"]
    static = []
    for t in targets:
        labels = {
            "namespace": namespace,
            "service": t.service,
            "job": t.service,
            "pod": t.pod_name,
            "container": "fleetserve",
            "endpoint": endpoint["port"],
        }
        for key in spec.get("podTargetLabels", []):
            if key in t.pod_labels:
                labels[prometheus_label(key)] = t.pod_labels[key]
        static.append({"targets": [t.address], "labels": labels})
    job = {
        "job_name": f"serviceMonitor/{namespace}/{monitor['metadata']['name']}/0",
        "metrics_path": endpoint.get("path", METRICS_PATH),
        "scrape_interval": interval or endpoint["interval"],
        "static_configs": static,
    }
    auth = endpoint.get("authorization")
    if auth is not None:
        ref = auth["credentials"]
        value = (secrets or {}).get((ref["name"], ref["key"]))
        if value is None:
            raise KeyError(f"the Secret key {ref['name']}:{ref['key']} the monitor names")
        job["authorization"] = {"type": auth["type"], "credentials": value}
    return job
