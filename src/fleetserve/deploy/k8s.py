"""`fleetserve deploy k8s`: a fleet file -> Kubernetes manifests, one pool per model.

Per model (`fleetserve-<model>`): a ConfigMap with the fleet file cut down to that model,
a Deployment running `fleetserve serve --config` on it, a Service for clients, a headless
Service (`-pods`) that lists the pods for a gateway and for Prometheus, a
PodDisruptionBudget and a KEDA ScaledObject on the model's queue depth. For the fleet: a
Namespace, one ServiceMonitor and a kustomization.yaml (`kubectl apply -k DIR`).

`--gateway` adds one endpoint over every model's pods (deploy/gateway.py); `--ray` renders
the fleet as one KubeRay RayService instead of the pools (deploy/kuberay.py), with a
Service of its head's Serve proxy for the ServiceMonitor (the ingress's /metrics). With
`--api-key-secret NAME[:KEY]` every server takes its API key from that Secret.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.deploy import keda, kuberay, monitoring, pods
from fleetserve.deploy.gateway import GATEWAY_NAME, GatewaySettings, render_gateway
from fleetserve.deploy.yaml_out import dump_yaml
from fleetserve.serve.config.deploy_config import DeployConfig
from fleetserve.serve.config.fleet_config import FleetConfig, ModelEntry, parse_fleet_config

DEFAULT_IMAGE = "fleetserve:0.1.0"
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
_PREFIX = "fleetserve-"
_MAX_SLUG = 45  # "fleetserve-" + slug + "-config" fits a 63-character DNS label


@dataclass(frozen=True)
class RenderOptions:
    namespace: str = "fleetserve"
    image: str = DEFAULT_IMAGE
    prometheus_url: str = DEFAULT_PROMETHEUS_URL
    port: int = 8000
    # Extra labels of the ServiceMonitor: a Prometheus picks monitors by label (the
    # kube-prometheus-stack chart's by `release: <its release name>`).
    monitor_labels: tuple[tuple[str, str], ...] = ()
    gateway: GatewaySettings | None = None
    ray: kuberay.RaySettings | None = None
    api_key: pods.SecretRef | None = None

    def __post_init__(self) -> None:
        if self.gateway is not None and self.ray is not None:
            raise ValueError("--gateway and --ray: on Ray the fleet's ingress is the gateway")
        if self.ray is not None and self.port != kuberay.SERVE_PORT:
            raise ValueError(f"--port {self.port}: with --ray, Serve's proxy listens on 8000")
        if len(self.namespace) > 63 or not _DNS_LABEL.match(self.namespace):
            raise ValueError(
                f"--namespace {self.namespace!r}: lower-case letters, digits and '-', "
                "at most 63 characters"
            )
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"--image {self.image!r}: an image reference without spaces")
        if not re.match(r"^https?://\S+$", self.prometheus_url):
            raise ValueError(f"--prometheus-url {self.prometheus_url!r}: an http(s) URL")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: 1..65535")
        for key, value in self.monitor_labels:
            if not (_LABEL_KEY.match(key) and _LABEL_VALUE.match(value)):
                raise ValueError(f"--monitor-label {key}={value}: not a Kubernetes label")


@dataclass(frozen=True)
class Manifest:
    filename: str
    obj: dict[str, Any]


def model_slug(model_name: str) -> str:
    """A model name as a DNS label part: `Qwen/Qwen2-7B` -> `qwen-qwen2-7b-<hash>`. Names
    that change on the way (case, characters, length) get a hash so two cannot meet."""
    slug = re.sub(r"[^a-z0-9]+", "-", model_name.lower()).strip("-")
    if slug == model_name and len(slug) <= _MAX_SLUG:
        return slug
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:8]
    return f"{slug[: _MAX_SLUG - 9].strip('-')}-{digest}".lstrip("-")


def pool_fleet_file(fleet: FleetConfig, entry: ModelEntry) -> dict[str, Any]:
    """The fleet file a pod of `entry`'s pool serves: that model and the classes, as the
    user wrote them (unset fields stay unset), without the deploy section."""
    data = fleet.model_dump(mode="json", exclude_unset=True)
    index = fleet.models.index(entry)
    model = {k: v for k, v in data["models"][index].items() if k != "deploy"}
    out: dict[str, Any] = {"models": [model]}
    for key in ("classes", "default_class"):
        if key in data:
            out[key] = data[key]
    parse_fleet_config(out, f"the fleet file of model {entry.name!r}")  # still a valid fleet
    return out


def _labels(name: str, slug: str, deploy: DeployConfig) -> tuple[dict[str, str], dict[str, str]]:
    selector = {"app.kubernetes.io/name": "fleetserve", "app.kubernetes.io/instance": name}
    labels = {
        **selector,
        "app.kubernetes.io/component": "model-server",
        monitoring.MODEL_LABEL: slug,
        monitoring.POOL_LABEL: deploy.pool,
    }
    return labels, selector


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def render_pool(fleet: FleetConfig, entry: ModelEntry, opts: RenderOptions) -> list[Manifest]:
    deploy = entry.deploy or DeployConfig()
    slug = model_slug(entry.name)
    name, ns = _PREFIX + slug, opts.namespace
    labels, selector = _labels(name, slug, deploy)
    fleet_yaml = dump_yaml(pool_fleet_file(fleet, entry))
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{name}-config", ns, labels),
        "data": {pods.CONFIG_FILE: fleet_yaml},
    }
    pod = pods.PodSettings(
        image=opts.image,
        port=opts.port,
        config_map=f"{name}-config",
        config_sha256=hashlib.sha256(fleet_yaml.encode()).hexdigest(),
        api_key=opts.api_key,
    )
    port = {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, ns, {**labels, "fleetserve/service": "api"}),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": [port]},
    }
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(f"{name}-pods", ns, {**labels, "fleetserve/service": "pods"}),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [{**port, "port": opts.port}],
        },
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, ns, labels),
        # maxUnavailable, not minAvailable: a one-pod pool must not block node drains.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }
    query = monitoring.queue_depth_query(ns, entry.name)
    scaler = keda.scaled_object(name, ns, labels, name, deploy, query, opts.prometheus_url)
    objects = {
        "configmap": config_map,
        "deployment": pods.deployment(name, ns, labels, selector, deploy, pod),
        "service": service,
        "service-pods": headless,
        "pdb": pdb,
        "scaledobject": scaler,
    }
    return [Manifest(f"{slug}-{kind}.yaml", obj) for kind, obj in objects.items()]


# A Ray-only key of a model entry -> what says the same on Kubernetes.
_RAY_ONLY_ON_K8S = {
    "autoscale": "KEDA scales pods: give the model `deploy: {min_replicas, max_replicas, "
    "target_queue_depth}` (per pod; `replicas` engine processes in each)",
    "placement": "a pod's resources come from `deploy: {cpu, memory, gpu, pool}`",
}


def _refuse_ray_only(index: int, entry: ModelEntry) -> None:
    """The pods run `fleetserve serve`, which refuses `autoscale`/`placement` (Ray only):
    shipping them in the ConfigMap would crash-loop every pod, so say so here instead."""
    for key, instead in _RAY_ONLY_ON_K8S.items():
        if getattr(entry, key) is not None:
            raise ValueError(
                f"models[{index}].{key} (model {entry.name!r}): only `fleetserve serve --ray` "
                f"honours it, and a pod runs `fleetserve serve`; {instead}, or render the "
                "fleet with --ray"
            )


def render_fleet(fleet: FleetConfig, opts: RenderOptions) -> list[Manifest]:
    for i, m in enumerate(fleet.models):
        if m.pools is not None and opts.ray is None:
            # Inside one pod, spot and on-demand replicas would share that pod's node.
            raise ValueError(
                f"models[{i}].pools (model {m.name!r}): on Kubernetes a pool is a set of "
                "pods on spot or on-demand nodes: give the model `deploy: {pool: spot}` (one "
                "model entry per pool) instead of `pools:`, which is for one server's "
                "replicas, or render it with --ray (a worker group per capacity)"
            )
        if opts.ray is None:
            _refuse_ray_only(i, m)
        if m.kind == "graph":  # serve/pipelines/graph_*.py runs its steps in one server
            raise ValueError(
                f"models[{i}].kind (model {m.name!r}): kind 'graph' is served by `fleetserve "
                "serve` (one server with its models) only; it is not rendered for Kubernetes yet"
            )
    slugs = [model_slug(m.name) for m in fleet.models]
    for i, slug in enumerate(slugs):
        if slugs.index(slug) != i:
            raise ValueError(
                f"models[{i}].name {fleet.models[i].name!r}: its Kubernetes name {slug!r} "
                f"is also that of {fleet.models[slugs.index(slug)].name!r}"
            )
    if opts.gateway is not None and "gateway" in slugs:
        i = slugs.index("gateway")
        raise ValueError(f"models[{i}].name {fleet.models[i].name!r}: its Kubernetes name "
                         f"is the gateway's ({GATEWAY_NAME})")  # fmt: skip
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": opts.namespace, "labels": {"app.kubernetes.io/name": "fleetserve"}},
    }
    out = [Manifest("namespace.yaml", namespace)]
    by_name = {m.name: slug for m, slug in zip(fleet.models, slugs, strict=True)}
    if opts.ray is not None:
        obj = kuberay.ray_service(
            fleet, opts.ray, by_name, opts.namespace, opts.image, opts.api_key
        )
        out.append(Manifest("rayservice.yaml", obj))
        service = kuberay.metrics_service(opts.namespace, monitoring.SERVICE_LABEL)
        selector = {"app.kubernetes.io/name": "fleetserve", monitoring.SERVICE_LABEL: "ray"}
        out += [Manifest("ray-metrics-service.yaml", service), _monitor(opts, selector, ())]
    else:
        out += _render_pods(fleet, opts, by_name)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": opts.namespace,
        "resources": [m.filename for m in out],
    }
    return [*out, Manifest("kustomization.yaml", kustomization)]


def _render_pods(fleet: FleetConfig, opts: RenderOptions, slugs: dict[str, str]) -> list[Manifest]:
    """The model pools, the gateway over them if asked for, and their ServiceMonitor."""
    out = []
    for entry in fleet.models:
        out += render_pool(fleet, entry, opts)
    selector = {"app.kubernetes.io/name": "fleetserve", monitoring.SERVICE_LABEL: "pods"}
    services: tuple[str, ...] = ()
    if opts.gateway is not None:
        objs = render_gateway(
            fleet, opts.gateway, slugs, opts.namespace, opts.image, opts.port, opts.api_key
        )
        out += [Manifest(f"gateway-{kind}.yaml", obj) for kind, obj in objs.items()]
        # Requests wait in the gateway's class queues: its series are the queue depth.
        selector = {"app.kubernetes.io/name": "fleetserve"}
        services = ("pods", "gateway")
    return [*out, _monitor(opts, selector, services)]


def _monitor(opts: RenderOptions, selector: dict[str, str], services: tuple[str, ...]) -> Manifest:
    key = opts.api_key
    monitor = monitoring.service_monitor(
        "fleetserve",
        opts.namespace,
        selector,
        dict(opts.monitor_labels),
        services=services,
        api_key=(key.name, key.key) if key is not None else None,
    )
    return Manifest("servicemonitor.yaml", monitor)


def write_manifests(manifests: list[Manifest], out_dir: str) -> list[Path]:
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for m in manifests:
        path = root / m.filename
        path.write_text(dump_yaml(m.obj), encoding="utf-8")
        paths.append(path)
    return paths


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the fleet file (fleet.yaml)")
    p.add_argument("--out", required=True, help="folder to write the manifests into")
    p.add_argument("--namespace", default=RenderOptions.namespace)
    p.add_argument("--image", default=DEFAULT_IMAGE, help="a fleetserve container image")
    p.add_argument(
        "--prometheus-url",
        default=DEFAULT_PROMETHEUS_URL,
        help="the Prometheus KEDA queries (default: the Prometheus operator's service)",
    )
    p.add_argument("--port", type=int, default=8000, help="the server's port in the pod")
    p.add_argument(
        "--monitor-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label of the ServiceMonitor, e.g. release=kube-prometheus-stack (repeatable)",
    )
    p.add_argument(
        "--api-key-secret",
        default=None,
        metavar="NAME[:KEY]",
        help="every server's API key from this Secret (key default: api-key)",
    )
    g = p.add_argument_group("gateway: one endpoint over every generate model's pods")
    g.add_argument("--gateway", action="store_true", help="render the gateway")
    g.add_argument("--gateway-replicas", type=int, help=f"default {GatewaySettings.replicas}")
    g.add_argument("--gateway-cpu", help=f"default {GatewaySettings.cpu}")
    g.add_argument("--gateway-memory", help=f"default {GatewaySettings.memory}")
    r = p.add_argument_group("ray: a KubeRay RayService instead of the pools")
    r.add_argument("--ray", action="store_true", help="render a RayService (KubeRay)")
    r.add_argument("--ray-head-cpu", help=f"default {kuberay.RaySettings.head_cpu}")
    r.add_argument("--ray-head-memory", help=f"default {kuberay.RaySettings.head_memory}")
    r.add_argument("--ray-version", help=f"the Ray of --image (default {kuberay.RAY_VERSION})")


def _settings(args: argparse.Namespace, flag: str, cls: Any) -> Any:
    """`cls` from the `--FLAG-*` options given, if `--FLAG` is; its options without it
    are refused rather than ignored."""
    prefix = f"{flag}_"
    given = {k: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}
    if not getattr(args, flag):
        if given:
            raise ValueError(f"--{next(iter(given)).replace('_', '-')}: give --{flag} too")
        return None
    return cls(**{k.removeprefix(prefix): v for k, v in given.items()})


def run(args: argparse.Namespace) -> int:
    from fleetserve.serve.config.fleet_config import load_fleet_config

    fleet = load_fleet_config(args.config)
    monitor_labels = []
    for item in args.monitor_label:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--monitor-label {item!r}: expected KEY=VALUE")
        monitor_labels.append((key, value))
    opts = RenderOptions(
        args.namespace,
        args.image,
        args.prometheus_url,
        args.port,
        tuple(monitor_labels),
        gateway=_settings(args, "gateway", GatewaySettings),
        ray=_settings(args, "ray", kuberay.RaySettings),
        api_key=pods.SecretRef.parse(args.api_key_secret) if args.api_key_secret else None,
    )  # fmt: skip
    paths = write_manifests(render_fleet(fleet, opts), args.out)
    print(f"wrote {len(paths)} files to {args.out}; apply with: kubectl apply -k {args.out}")
    if opts.gateway is not None:
        own = [m.name for m in fleet.models if m.kind != "generate"]
        if own:
            print(f"the gateway routes the generate models; {', '.join(own)} (embed/custom) "
                  "stay at their own Services")  # fmt: skip
    return 0
