"""`fleetserve deploy k8s --gateway` and `--ray`: the gateway's objects validate and its
fleet file is one fleetserve reads as remote pools over the models' headless Services; the
RayService validates against KubeRay's CRD, carries the fleet, and Ray itself builds the
application from it; what cannot work is refused with the key's path."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from fleetserve.deploy import kuberay, scheduling
from fleetserve.deploy.gateway import GatewaySettings
from fleetserve.deploy.k8s import RenderOptions, model_slug, render_fleet
from fleetserve.deploy.pods import SecretRef
from fleetserve.entrypoints.cli import main
from fleetserve.serve.config.fleet_config import parse_fleet_config
from k8s_schemas import validate
from test_deploy_k8s import FLEET

# The shared fleet: its `chat` pool scales to zero (min_replicas 0), behind the gateway too.
GW_FLEET = FLEET


def render(fleet: dict[str, Any] = GW_FLEET, **opts: Any) -> dict[str, dict[str, Any]]:
    return {m.filename: m.obj for m in render_fleet(parse_fleet_config(fleet), RenderOptions(**opts))}  # fmt: skip


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_gateway_objects_validate_and_route_over_every_generate_models_pods() -> None:
    key = SecretRef("fleet-key", "token")
    objs = render(namespace="llm", gateway=GatewaySettings(replicas=3), api_key=key)
    kustomization = objs.pop("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(objs)
    assert {f"gateway-{k}.yaml" for k in ("configmap", "deployment", "service", "pdb")} <= set(objs)
    for obj in objs.values():
        validate(obj)
    services = [o for o in objs.values() if o["kind"] == "Service"]
    headless = {s["metadata"]["labels"].get("fleetserve/model"): s for s in services
                if s["spec"].get("clusterIP") == "None"}  # fmt: skip

    # The gateway's fleet file, read by fleetserve's own parser: each generate model is a
    # remote pool on its pods' headless Service (name, namespace and port as rendered).
    dep = objs["gateway-deployment.yaml"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][:3] == ["serve", "--config", "/etc/fleetserve/fleet.yaml"]
    (config_volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    config_map = objs["gateway-configmap.yaml"]
    assert config_volume["configMap"]["name"] == config_map["metadata"]["name"]
    gw = parse_fleet_config(yaml.safe_load(config_map["data"]["fleet.yaml"]))
    assert [m.name for m in gw.models] == ["chat", "Qwen/Qwen2-0.5B"]  # clf is custom
    for m in gw.models:
        svc = headless[model_slug(m.name)]
        assert m.remote is not None and m.deploy is None and m.replicas == 1
        assert (
            m.remote.dns == f"{svc['metadata']['name']}.llm.svc:{svc['spec']['ports'][0]['port']}"
        )
        assert m.remote.api_key_env == "FLEETSERVE_API_KEY"
    assert gw.models[0].engine.max_num_seqs == 32  # type: ignore[union-attr]  # it tokenizes
    assert gw.models[1].model == "/models/qwen2"
    assert gw.classes["batch"].max_waiting == 9 and gw.default_class == "interactive"

    # Its pods and every model's take the key from the Secret, under the server's variable.
    secret_env = {"name": "FLEETSERVE_API_KEY",
                  "valueFrom": {"secretKeyRef": {"name": "fleet-key", "key": "token"}}}  # fmt: skip
    for d in (o for o in objs.values() if o["kind"] == "Deployment"):
        assert secret_env in d["spec"]["template"]["spec"]["containers"][0]["env"]
    assert dep["spec"]["replicas"] == 3
    # It does not wait for pods (a pool may be at zero: its requests wait in the gateway).
    probes = {
        p: c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes == dict.fromkeys(("startupProbe", "readinessProbe", "livenessProbe"), "/live")
    assert pod["affinity"] == scheduling.node_affinity("on_demand")

    # The Service and PDB pick the gateway's pods; the ServiceMonitor scrapes the gateway
    # (the queue is there) and the pods once each (not through their ClusterIP Service too).
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": objs["gateway-service.yaml"]["spec"]["selector"]}, pod_labels)
    assert selects(objs["gateway-pdb.yaml"]["spec"]["selector"], pod_labels)
    monitor = objs["servicemonitor.yaml"]["spec"]["selector"]
    scraped = {s["metadata"]["name"] for s in services if selects(monitor, s["metadata"]["labels"])}
    assert scraped == {"fleetserve-gateway"} | {s["metadata"]["name"] for s in headless.values()}
    # /metrics takes the API key: the scrape sends the Secret's (else every target is 401).
    (endpoint,) = objs["servicemonitor.yaml"]["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "fleet-key", "key": "token"},
    }


def test_without_a_secret_nothing_names_a_key() -> None:
    objs = render(gateway=GatewaySettings())
    gw = parse_fleet_config(yaml.safe_load(objs["gateway-configmap.yaml"]["data"]["fleet.yaml"]))
    assert all(m.remote and m.remote.api_key_env is None for m in gw.models)
    for d in (o for o in objs.values() if o["kind"] == "Deployment"):
        env = d["spec"]["template"]["spec"]["containers"][0]["env"]
        assert [e["name"] for e in env] == ["FLEETSERVE_CACHE"]
    assert "authorization" not in objs["servicemonitor.yaml"]["spec"]["endpoints"][0]


def _with(path: str, value: Any, fleet: dict[str, Any] = GW_FLEET) -> dict[str, Any]:
    out = copy.deepcopy(fleet)
    *parents, last = path.split(".")
    node: Any = out
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[last] = value
    return out


@pytest.mark.parametrize(
    "fleet,opts,message",
    [
        ({"models": [FLEET["models"][2]]}, {"gateway": GatewaySettings()},
         "--gateway: the fleet has no generate model"),
        (_with("models.2.name", "gateway"), {"gateway": GatewaySettings()},
         r"models\[2\]\.name 'gateway'.* the gateway's \(fleetserve-gateway\)"),
        (_with("models.0.placement", {"num_cpus": 2}), {"ray": kuberay.RaySettings()},
         r"models\[0\]\.placement \(model 'chat'\): `deploy k8s --ray` derives it"),
        (_with("models.0.deploy.pool", "cheap"), {}, r"models\[0\]\.deploy\.pool"),
    ],
)  # fmt: skip
def test_what_cannot_work_is_refused_with_the_key(
    fleet: dict[str, Any], opts: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        render(fleet, **opts)


def test_bad_flags_are_refused_with_the_flag() -> None:
    with pytest.raises(ValueError, match="--gateway and --ray"):
        RenderOptions(gateway=GatewaySettings(), ray=kuberay.RaySettings())
    with pytest.raises(ValueError, match="--port 9000: with --ray"):
        RenderOptions(ray=kuberay.RaySettings(), port=9000)
    with pytest.raises(ValueError, match="--gateway-cpu '2 cores'"):
        GatewaySettings(cpu="2 cores")
    with pytest.raises(ValueError, match="--gateway-replicas 0"):
        GatewaySettings(replicas=0)
    with pytest.raises(ValueError, match="--ray-head-memory '8 GB'"):
        kuberay.RaySettings(head_memory="8 GB")
    with pytest.raises(ValueError, match="--ray-version 'latest'"):
        kuberay.RaySettings(version="latest")
    with pytest.raises(ValueError, match="--api-key-secret 'Keys'"):
        SecretRef.parse("Keys")
    assert SecretRef.parse("keys:token") == SecretRef("keys", "token")


def _ray_service(**opts: Any) -> dict[str, Any]:
    objs = render(FLEET, ray=kuberay.RaySettings(), **opts)
    # The RayService runs the fleet: no pools of Deployments beside it (they would run it
    # twice); Prometheus scrapes the ingress through the head's Serve proxy.
    files = ["namespace.yaml", "rayservice.yaml", "ray-metrics-service.yaml", "servicemonitor.yaml"]
    assert sorted(objs) == sorted([*files, "kustomization.yaml"])
    assert objs["kustomization.yaml"]["resources"] == files
    return objs["rayservice.yaml"]


def test_ray_metrics_are_scraped_from_the_head() -> None:
    objs = render(FLEET, ray=kuberay.RaySettings(), namespace="llm",
                  monitor_labels=(("release", "kps"),), api_key=SecretRef("fleet-key"))  # fmt: skip
    service, monitor = objs["ray-metrics-service.yaml"], objs["servicemonitor.yaml"]
    for obj in (service, monitor):
        validate(obj)
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": "fleet-key", "key": "api-key"}
    # The Service picks the head pod, at its Serve proxy's port (where the ingress answers).
    head = objs["rayservice.yaml"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert selects({"matchLabels": service["spec"]["selector"]}, head["metadata"]["labels"])
    (container,) = head["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == kuberay.SERVE_PORT == port["port"]
    workers = objs["rayservice.yaml"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert all(
        not selects(
            {"matchLabels": service["spec"]["selector"]}, g["template"]["metadata"]["labels"]
        )
        for g in workers
    )


def test_ray_service_validates_and_carries_the_fleet() -> None:
    rs = _ray_service(namespace="llm", api_key=SecretRef("fleet-key"))
    validate(rs)
    assert rs["metadata"]["namespace"] == "llm"
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert (app["import_path"], app["route_prefix"]) == (kuberay.IMPORT_PATH, "/")
    fleet = parse_fleet_config(app["args"])
    assert [m.name for m in fleet.models] == [m["name"] for m in FLEET["models"]]
    assert fleet.classes["batch"].max_waiting == 9 and fleet.default_class == "interactive"
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["resources"] == {"CPU": "0"}  # no replica on the head
    assert head["template"]["spec"]["affinity"] == scheduling.node_affinity("on_demand")
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert sorted(groups) == ["chat", "clf", "qwen-qwen2-0-5b-841652bc"]
    for entry, written in zip(fleet.models, FLEET["models"], strict=True):
        deploy = parse_fleet_config({"models": [written]}).models[0].deploy
        pool = deploy.pool if deploy else "on_demand"
        group = groups[model_slug(entry.name)]
        spec = group["template"]["spec"]
        assert spec["affinity"] == scheduling.node_affinity(pool)
        assert spec.get("tolerations", []) == scheduling.tolerations(
            pool, deploy.gpu if deploy else 0
        )
        # Its replicas need the group's own resource, which the group's pods offer: they land
        # there only, `replicas` (engines per pod) of them per pod, within the pod's CPUs.
        assert entry.placement is not None and entry.autoscale is not None
        (pin,) = entry.placement.resources
        per_pod = float(group["resources"][pin])
        assert per_pod == written.get("replicas", 1)
        assert entry.placement.num_cpus * per_pod <= float(group["resources"]["CPU"])
        assert entry.autoscale.min_replicas == group["minReplicas"] * per_pod
        assert entry.autoscale.max_replicas == group["maxReplicas"] * per_pod
        env = spec["containers"][0]["env"]
        assert {"name": "FLEETSERVE_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "fleet-key", "key": "api-key"}}} in env  # fmt: skip
    chat = groups["chat"]
    assert (chat["minReplicas"], chat["maxReplicas"]) == (0, 8)  # chat's deploy section
    assert chat["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert chat["resources"]["GPU"] == "1"
    assert fleet.models[0].autoscale.target_queue_depth == 6  # type: ignore[union-attr]


BROKEN_RAY = [
    (lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0].update(minReplicas="1"),
     jsonschema.ValidationError),  # wrong type
    (lambda s: s["rayClusterConfig"].update(enableAutoscaling=True),
     jsonschema.ValidationError),  # unknown field (a typo)
    (lambda s: s["rayClusterConfig"]["headGroupSpec"].pop("template"),
     jsonschema.ValidationError),  # required
    (lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"].update({"num-cpus": 4}),
     jsonschema.ValidationError),  # rayStartParams is a map of strings
    (lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
     .update(imagePullPolicy=None), jsonschema.ValidationError),  # the pod template's schema
    (lambda s: s["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
     .update(terminationGracePeriod=30), jsonschema.ValidationError),  # a typo, in the pod
]  # fmt: skip


@pytest.mark.parametrize("mutate,error", BROKEN_RAY)
def test_a_broken_ray_service_fails_validation(mutate: Any, error: type) -> None:
    rs = copy.deepcopy(_ray_service())
    mutate(rs["spec"])
    with pytest.raises(error):
        validate(rs)


def test_ray_builds_the_application_from_the_serve_config() -> None:
    """Ray's own config schema and builder call: what KubeRay's Serve does with
    serveConfigV2 (a two-argument build_app would be refused here)."""
    pytest.importorskip("ray.serve")
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as ray_build_app
    from ray.serve.schema import ServeDeploySchema

    fleet = {
        "models": [
            {"name": "chat", "engine": {"max_num_seqs": 8},
             "deploy": {"cpu": "500m", "pool": "spot", "max_replicas": 3}},
            {"name": "clf", "kind": "custom", "handler": "pkg.mod:Classifier"},
        ]
    }  # fmt: skip
    rs = render(fleet, ray=kuberay.RaySettings())["rayservice.yaml"]
    validate(rs)
    config = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    (app,) = config.applications
    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
    deployments = {d.name: d for d in ray_build_app(built, name=app.name).deployments}
    assert sorted(deployments) == ["ingress", "model-chat", "model-clf"]
    chat = deployments["model-chat"]
    assert chat.ray_actor_options == {"num_cpus": 1.0, "resources": {"fleetserve-chat": 1.0}}
    auto = chat._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas) == (1, 3)


def test_cli_gateway_and_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(GW_FLEET, sort_keys=False))
    out = tmp_path / "gw"
    args = ["deploy", "k8s", "--config", str(config), "--out", str(out)]
    assert main([*args, "--gateway", "--gateway-replicas", "4", "--api-key-secret", "k:t"]) == 0
    assert "clf (embed/custom) stay at their own Services" in capsys.readouterr().out
    dep = yaml.safe_load((out / "gateway-deployment.yaml").read_text())
    assert (
        dep
        == render(gateway=GatewaySettings(4), api_key=SecretRef("k", "t"))[
            "gateway-deployment.yaml"
        ]
    )
    ray_out = tmp_path / "ray"
    ray_args = ["deploy", "k8s", "--config", str(config), "--out", str(ray_out), "--ray"]
    assert main([*ray_args, "--ray-head-cpu", "4"]) == 0
    text = (ray_out / "rayservice.yaml").read_text()
    assert "serveConfigV2: |" in text  # the Serve config reads as YAML, not an escaped string
    rs = yaml.safe_load(text)
    validate(rs)
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["requests"]["cpu"] == "4"
    assert main([*ray_args, "--gateway"]) == 2
    assert "--gateway and --ray" in capsys.readouterr().err
    # A setting of the gateway or of Ray without its flag is refused, not ignored.
    assert main([*args, "--gateway-cpu", "4"]) == 2
    assert "--gateway-cpu: give --gateway too" in capsys.readouterr().err
    assert main([*args, "--ray-version", "2.60.0"]) == 2
    assert "--ray-version: give --ray too" in capsys.readouterr().err


def test_kustomize_builds_the_gateway_and_ray_folders(tmp_path: Path) -> None:
    pytest.importorskip("shutil").which("kubectl") or pytest.skip("needs kubectl")
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(GW_FLEET, sort_keys=False))
    for flag in ("--gateway", "--ray"):
        out = tmp_path / flag.strip("-")
        assert main(["deploy", "k8s", "--config", str(config), "--out", str(out), flag]) == 0
        built = subprocess.run(
            ["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=60
        )
        assert built.returncode == 0, built.stderr
        kinds = {d["kind"] for d in yaml.safe_load_all(built.stdout) if d}
        assert ("RayService" in kinds) == (flag == "--ray")
        assert ("Deployment" in kinds) == (flag == "--gateway")
