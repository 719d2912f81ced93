"""`fleetserve deploy k8s`: every rendered object validates (core kinds with
kubernetes-validate, strict; KEDA and Prometheus-operator objects with their CRDs' schemas),
broken ones do not, and the manifests say what the server and the fleet file say."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from fleetserve.deploy import pods
from fleetserve.deploy.k8s import RenderOptions, model_slug, render_fleet
from fleetserve.entrypoints.cli import main
from fleetserve.serve.config.fleet_config import parse_fleet_config
from k8s_schemas import NameError_, validate

FLEET: dict[str, Any] = {
    "models": [
        {
            "name": "chat",
            "engine": {"max_num_seqs": 32},
            "deploy": {
                "pool": "spot",
                "cpu": 4,
                "memory": "16Gi",
                "gpu": 1,
                "min_replicas": 0,
                "max_replicas": 8,
                "target_queue_depth": 6,
                "activation_queue_depth": 0.5,
                "cooldown_s": 120,
                "drain_timeout_s": 45,
            },
        },  # fmt: skip
        {"name": "Qwen/Qwen2-0.5B", "model": "/models/qwen2", "replicas": 2},
        {"name": "clf", "kind": "custom", "handler": "pkg.mod:Classifier"},
    ],
    "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10, "max_waiting": 9}},
    "default_class": "interactive",
}


def render(fleet: dict[str, Any] = FLEET, **opts: Any) -> dict[str, dict[str, Any]]:
    manifests = render_fleet(parse_fleet_config(fleet), RenderOptions(**opts))
    return {m.filename: m.obj for m in manifests}


def of_kind(objs: dict[str, dict[str, Any]], kind: str, model: str) -> dict[str, Any]:
    (obj,) = [
        o
        for o in objs.values()
        if o["kind"] == kind and o["metadata"]["labels"].get("fleetserve/model") == model
    ]
    return obj


def test_every_object_validates_and_the_kustomization_lists_them() -> None:
    objs = render(namespace="llm", image="registry.example/fleetserve:1.2")
    kinds = sorted(o["kind"] for o in objs.values())
    assert kinds.count("Deployment") == 3 and kinds.count("ScaledObject") == 3
    assert {"Namespace", "ServiceMonitor", "Kustomization", "PodDisruptionBudget"} <= set(kinds)
    kustomization = objs.pop("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(objs)
    for name, obj in objs.items():
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "llm", name


BROKEN = [
    # (kind, mutation, error class): each must fail validation.
    ("Deployment", lambda o: o["spec"]["template"]["spec"].update(terminationGracePeriod=3),
     kubernetes_validate.ValidationError),  # unknown field (a typo)
    ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0]["ports"][0]
     .update(containerPort="8000"), kubernetes_validate.ValidationError),  # wrong type
    ("Service", lambda o: o["spec"].update(ports="http"), kubernetes_validate.ValidationError),
    ("ScaledObject", lambda o: o["spec"]["triggers"][0]["metadata"].update(threshold=8),
     jsonschema.ValidationError),  # trigger metadata is a map of strings
    ("ScaledObject", lambda o: o["spec"].pop("scaleTargetRef"), jsonschema.ValidationError),
    ("ScaledObject", lambda o: o["spec"].update(minReplicas=1), jsonschema.ValidationError),
    ("ScaledObject", lambda o: o["metadata"].update(name="Not_A_Name"), NameError_),
    ("Service", lambda o: o["metadata"].update(name="9lives"), NameError_),
    ("Deployment", lambda o: o["metadata"]["labels"].update({"fleetserve/pool": "on demand"}),
     NameError_),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(interval="fast"),
     jsonschema.ValidationError),  # not a Prometheus duration
    ("ServiceMonitor", lambda o: o["spec"].update(podTargetLabel=["x"]),
     jsonschema.ValidationError),
]  # fmt: skip


@pytest.mark.parametrize("kind,mutate,error", BROKEN)
def test_a_broken_manifest_fails_validation(kind: str, mutate: Any, error: type) -> None:
    objs = render()
    obj = copy.deepcopy(next(o for o in objs.values() if o["kind"] == kind))
    validate(obj)
    mutate(obj)
    with pytest.raises(error):
        validate(obj)


def test_deployment_runs_the_pool_fleet_file_with_probes_and_drain_budget() -> None:
    objs = render()
    dep = of_kind(objs, "Deployment", "chat")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["fleetserve"] and c["args"][:3] == [
        "serve",
        "--config",
        "/etc/fleetserve/fleet.yaml",
    ]
    assert c["args"][c["args"].index("--drain-timeout") + 1] == "45"
    assert "replicas" not in dep["spec"]  # KEDA owns the count
    # The drain fits the grace period: preStop sleep, then the server's drain, then exit.
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] == pre_stop + 45 + pods.SHUTDOWN_MARGIN_S
    paths = {
        p: c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert paths == {
        "startupProbe": "/health",
        "readinessProbe": "/ready",
        "livenessProbe": "/live",
    }
    assert {c[p]["httpGet"]["port"] for p in paths} == {c["ports"][0]["name"]}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 900
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": 1},
    }
    # The ConfigMap it mounts holds a valid fleet file with this model only, no deploy section.
    config_map = of_kind(objs, "ConfigMap", "chat")
    assert spec["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
    served = parse_fleet_config(yaml.safe_load(config_map["data"]["fleet.yaml"]))
    assert [m.name for m in served.models] == ["chat"] and served.models[0].deploy is None
    assert served.models[0].engine.max_num_seqs == 32  # type: ignore[union-attr]
    assert served.classes["batch"].max_waiting == 9 and served.default_class == "interactive"
    # Selectors meet: Services and the PDB select the Deployment's pods.
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selectors = [
        dep["spec"]["selector"]["matchLabels"],
        of_kind(objs, "PodDisruptionBudget", "chat")["spec"]["selector"]["matchLabels"],
    ]
    services = [
        o
        for o in objs.values()
        if o["kind"] == "Service" and o["metadata"]["labels"]["fleetserve/model"] == "chat"
    ]
    assert sorted(s["spec"].get("clusterIP", "") for s in services) == ["", "None"]
    selectors += [s["spec"]["selector"] for s in services]
    for sel in selectors:
        assert sel.items() <= pod_labels.items()
    for s in services:
        assert s["spec"]["ports"][0]["targetPort"] == "http"  # fmt: skip


def test_scaled_object_reads_the_model_queue_depth() -> None:
    objs = render(namespace="llm", prometheus_url="http://prom.monitoring:9090")
    so = of_kind(objs, "ScaledObject", "chat")["spec"]
    assert so["scaleTargetRef"]["name"] == of_kind(objs, "Deployment", "chat")["metadata"]["name"]
    assert (so["minReplicaCount"], so["maxReplicaCount"], so["cooldownPeriod"]) == (0, 8, 120)
    (trigger,) = so["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"] == {
        "serverAddress": "http://prom.monitoring:9090",
        "query": 'sum(fleetserve:num_requests_waiting{namespace="llm",model_name="chat"})',
        "threshold": "6",
        "activationThreshold": "0.5",
        "ignoreNullValues": "true",
    }
    qwen = of_kind(objs, "ScaledObject", model_slug("Qwen/Qwen2-0.5B"))["spec"]
    assert 'model_name="Qwen/Qwen2-0.5B"' in qwen["triggers"][0]["metadata"]["query"]
    assert (qwen["minReplicaCount"], qwen["maxReplicaCount"]) == (1, 4)  # the defaults


def _affinity_terms(objs: dict[str, dict[str, Any]], model: str) -> list[list[dict[str, Any]]]:
    spec = of_kind(objs, "Deployment", model)["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [t["matchExpressions"] for t in terms["nodeSelectorTerms"]]


def test_spot_pools_land_on_spot_nodes_of_any_provider_on_demand_never() -> None:
    objs = render()
    spot = _affinity_terms(objs, "chat")
    # Node selector terms are ORed: a node of any one provider's spot pool will do.
    assert {(e["key"], e["operator"], e["values"][0]) for (e,) in spot} >= {
        ("cloud.google.com/gke-spot", "In", "true"),
        ("eks.amazonaws.com/capacityType", "In", "SPOT"),
        ("kubernetes.azure.com/scalesetpriority", "In", "spot"),
    }
    tolerated = {(t["key"], t.get("value")) for t in
                 of_kind(objs, "Deployment", "chat")["spec"]["template"]["spec"]["tolerations"]}  # fmt: skip
    assert ("kubernetes.azure.com/scalesetpriority", "spot") in tolerated
    assert ("cloud.google.com/gke-spot", "true") in tolerated
    # On-demand: one term whose expressions are ANDed: no provider's spot label.
    (on_demand,) = _affinity_terms(objs, "clf")
    assert {(e["key"], e["operator"], e["values"][0]) for e in on_demand} == {
        (key, "NotIn", value) for (e,) in spot for key, value in [(e["key"], e["values"][0])]
    }
    assert "tolerations" not in of_kind(objs, "Deployment", "clf")["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "deploy,key,message",
    [
        ({"min_replicas": 5, "max_replicas": 2}, "deploy", "max_replicas (2) must be >= min_replicas (5)"),
        ({"memory": "16 GB"}, "deploy.memory", "'16 GB' is not a Kubernetes quantity"),
        ({"cpu": True}, "deploy.cpu", "Input should be a valid string"),
        ({"pool": "preemptible"}, "deploy.pool", "Input should be 'spot' or 'on_demand'"),
        ({"gpus": 1}, "deploy.gpus", "Extra inputs are not permitted"),
        ({"target_queue_depth": 0}, "deploy.target_queue_depth", "greater than 0"),
    ],
)  # fmt: skip
def test_bad_deploy_config_names_the_key(deploy: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_fleet_config({"models": [{"name": "m", "deploy": deploy}]})
    assert str(e.value).startswith(f"fleet config: models[0].{key} (model 'm'): ")
    assert message in str(e.value)


def test_names_and_options() -> None:
    assert model_slug("chat") == "chat"
    assert model_slug("Chat") != model_slug("chat")  # a changed name carries a hash
    long = model_slug("x" * 200)
    assert len("fleetserve-" + long + "-config") <= 63
    with pytest.raises(ValueError, match="--namespace 'Bad_NS'"):
        RenderOptions(namespace="Bad_NS")
    with pytest.raises(ValueError, match="--image"):
        RenderOptions(image="my image")
    with pytest.raises(ValueError, match="--monitor-label release=a b"):
        RenderOptions(monitor_labels=(("release", "a b"),))


def test_cli_writes_plain_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(FLEET, sort_keys=False))
    out = tmp_path / "out"
    assert (
        main(["deploy", "k8s", "--config", str(config), "--out", str(out), "--namespace", "ns1"])
        == 0
    )
    assert "kubectl apply -k" in capsys.readouterr().out
    text = (out / "chat-deployment.yaml").read_text()
    assert "{" not in text.split("fleetserve/config-sha256")[0]  # block style, no flow maps
    assert "&" not in text and "*id" not in text  # no YAML anchors
    assert yaml.safe_load(text) == render(namespace="ns1")["chat-deployment.yaml"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    deploy: {pool: cheap}\n")
    assert main(["deploy", "k8s", "--config", str(bad), "--out", str(out)]) == 2
    assert "models[0].deploy.pool" in capsys.readouterr().err
    args = ["--config", str(config), "--out", str(out), "--monitor-label", "release=kps"]
    assert main(["deploy", "k8s", *args]) == 0
    monitor = yaml.safe_load((out / "servicemonitor.yaml").read_text())
    assert monitor["metadata"]["labels"]["release"] == "kps"
    validate(monitor)
    assert main(["deploy", "k8s", *args[:-1], "release"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_promql_quoting_and_the_implied_scrape_labels() -> None:
    from fleetserve.deploy.monitoring import (
        ScrapeTarget,
        implied_scrape_config,
        queue_depth_query,
    )

    assert queue_depth_query("ns", 'a"b\\c') == (
        'sum(fleetserve:num_requests_waiting{namespace="ns",model_name="a\\"b\\\\c"})'
    )
    objs = render(namespace="llm")
    monitor = objs["servicemonitor.yaml"]
    labels = of_kind(objs, "Deployment", "chat")["spec"]["template"]["metadata"]["labels"]
    target = ScrapeTarget("10.0.0.7:8000", "fleetserve-chat-abc", "fleetserve-chat-pods", labels)
    job = implied_scrape_config(monitor, [target])
    assert job["metrics_path"] == "/metrics" and job["scrape_interval"] == "15s"
    assert job["static_configs"] == [
        {
            "targets": ["10.0.0.7:8000"],
            "labels": {
                "namespace": "llm",
                "service": "fleetserve-chat-pods",
                "job": "fleetserve-chat-pods",
                "pod": "fleetserve-chat-abc",
                "container": "fleetserve",
                "endpoint": "http",
                "fleetserve_model": "chat",
                "fleetserve_pool": "spot",
            },
        }
    ]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its kustomize)")
def test_kustomize_builds_the_folder(tmp_path: Path) -> None:
    """`kubectl kustomize` (what `kubectl apply -k` runs first) reads the kustomization and
    every file it names; no cluster needed."""
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(FLEET, sort_keys=False))
    out = tmp_path / "out"
    assert main(["deploy", "k8s", "--config", str(config), "--out", str(out)]) == 0
    built = subprocess.run(
        ["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    rendered = [o for o in render().values() if o["kind"] != "Kustomization"]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, docs)) == sorted(map(key, rendered))
    assert {d["metadata"].get("namespace", "fleetserve") for d in docs} == {"fleetserve"}


def test_pools_are_refused_with_the_deploy_alternative() -> None:
    from fleetserve.deploy.k8s import RenderOptions, render_fleet
    from fleetserve.serve.config.fleet_config import parse_fleet_config

    fleet = parse_fleet_config(
        {
            "models": [
                {
                    "name": "chat",
                    "pools": [
                        {"name": "spot", "capacity": "spot", "replicas": 1},
                        {"name": "base", "capacity": "on_demand", "replicas": 1},
                    ],
                }
            ]
        }
    )
    with pytest.raises(ValueError, match=r"models\[0\].pools .*deploy: \{pool: spot\}"):
        render_fleet(fleet, RenderOptions())


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("autoscale", {"min_replicas": 0, "max_replicas": 4}, "deploy: {min_replicas"),
        ("placement", {"num_cpus": 2}, "deploy: {cpu, memory"),
    ],
)
def test_ray_only_keys_are_refused_with_their_path(key: str, value: Any, instead: str) -> None:
    # `fleetserve serve` in the pod refuses them: shipping them would crash-loop every pod.
    fleet = {"models": [{"name": "embed", "kind": "embed"}, {"name": "chat", key: value}]}
    with pytest.raises(
        ValueError, match=rf"models\[1\]\.{key} \(model 'chat'\).*{re.escape(instead)}"
    ):
        render(fleet)
