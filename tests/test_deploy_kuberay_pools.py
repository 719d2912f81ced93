"""`fleetserve deploy k8s --ray` with `pools:`: a worker group per capacity on spot or
on-demand nodes, offering the capacity resource its pool's replicas ask for. Validated
against KubeRay's CRD; Ray's own config schema and builder make the deployments from the
serveConfigV2, and each pool's replicas fit on its own group's pods and nowhere else."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from fleetserve.deploy import kuberay, scheduling
from fleetserve.deploy.k8s import RenderOptions, render_fleet
from fleetserve.serve.config.fleet_config import parse_fleet_config
from k8s_schemas import validate

FLEET: dict[str, Any] = {
    "models": [
        {"name": "chat", "engine": {"max_num_seqs": 8},
         "pools": [{"name": "spot", "capacity": "spot", "replicas": 2, "overprovision": 1},
                   {"name": "base", "capacity": "on_demand", "replicas": 1, "max_fallback": 2}],
         "deploy": {"cpu": "3", "memory": "12Gi", "gpu": 1}},
        {"name": "other", "engine": {"max_num_seqs": 4},
         "deploy": {"cpu": "2", "pool": "spot", "min_replicas": 1, "max_replicas": 2}},
    ],
    "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}},
    "default_class": "interactive",
}  # fmt: skip


def ray_service(fleet: dict[str, Any] = FLEET) -> dict[str, Any]:
    objs = {
        m.filename: m.obj
        for m in render_fleet(parse_fleet_config(fleet), RenderOptions(ray=kuberay.RaySettings()))
    }
    return objs["rayservice.yaml"]


def test_a_worker_group_per_capacity_on_its_nodes() -> None:
    rs = ray_service()
    validate(rs)
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert sorted(groups) == ["chat-on-demand", "chat-spot", "other"]
    for name, capacity, low, high in (("chat-spot", "spot", 3, 3),
                                      ("chat-on-demand", "on_demand", 1, 3)):  # fmt: skip
        g = groups[name]
        # Spot: replicas + overprovision; on-demand: the base, up to base + max_fallback.
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (low, low, high)
        spec = g["template"]["spec"]
        assert spec["affinity"] == scheduling.node_affinity(capacity)
        assert spec["tolerations"] == scheduling.tolerations(capacity, 1)
        assert g["template"]["metadata"]["labels"]["fleetserve/pool"] == capacity
        # One replica per pod: the deploy section sizes the pod.
        assert g["resources"] == {"CPU": "3", "fleetserve-chat": "1", capacity: "1", "GPU": "1"}
        (c,) = spec["containers"]
        assert c["resources"]["requests"] == {"cpu": "3", "memory": "12Gi"}
    # The head (on-demand) offers the on-demand resource the ingress asks for, no CPUs.
    assert cluster["headGroupSpec"]["resources"] == {"CPU": "0", "on_demand": "1"}
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    chat = parse_fleet_config(app["args"]).models[0]
    assert chat.pools is not None and chat.autoscale is None  # PoolPolicy sizes the pools
    assert chat.placement is not None and chat.placement.num_cpus == 3.0


def _fits(actor: dict[str, Any], offered: dict[str, str]) -> bool:
    """Whether a node offering `offered` (a group's Ray resources) can run the actor."""
    asked = {"CPU": actor.get("num_cpus", 1.0), **actor.get("resources", {})}
    return all(amount <= float(offered.get(name, 0)) for name, amount in asked.items() if amount)


def test_ray_places_each_pools_replicas_on_its_groups_pods() -> None:
    """Serve's config schema and builder call (what KubeRay's Serve does with the
    serveConfigV2), then each deployment's replica against every group's resources."""
    pytest.importorskip("ray.serve")
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as ray_build_app
    from ray.serve.schema import ServeDeploySchema

    rs = ray_service()
    config = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    (app,) = config.applications
    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
    deployments = {d.name: d for d in ray_build_app(built, name=app.name).deployments}
    assert sorted(deployments) == ["ingress", "model-chat--base", "model-chat--spot",
                                   "model-other"]  # fmt: skip
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["resources"] for g in cluster["workerGroupSpecs"]}
    groups["head"] = cluster["headGroupSpec"]["resources"]

    def hosts(deployment: str) -> set[str]:
        actor = deployments[deployment].ray_actor_options
        return {name for name, offered in groups.items() if _fits(actor, offered)}

    assert hosts("model-chat--spot") == {"chat-spot"}
    assert hosts("model-chat--base") == {"chat-on-demand"}
    assert hosts("model-other") == {"other"}
    assert "head" in hosts("ingress") and "chat-spot" not in hosts("ingress")
    # Serve's bounds for each pool are its group's pods (a replica per pod).
    for deployment, group in (("model-chat--spot", "chat-spot"),
                              ("model-chat--base", "chat-on-demand")):  # fmt: skip
        auto = deployments[deployment]._deployment_config.autoscaling_config
        spec = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == group)
        assert (auto.min_replicas, auto.max_replicas) == (spec["minReplicas"], spec["maxReplicas"])


def _with_deploy(**deploy: Any) -> dict[str, Any]:
    fleet = copy.deepcopy(FLEET)
    fleet["models"][0]["deploy"].update(deploy)
    return fleet


@pytest.mark.parametrize("key,value", [("pool", "spot"), ("min_replicas", 0),
                                       ("max_replicas", 9), ("target_queue_depth", 2.0)])  # fmt: skip
def test_what_the_pools_decide_is_refused_in_deploy(key: str, value: Any) -> None:
    with pytest.raises(
        ValueError, match=rf"models\[0\]\.deploy\.{key} \(model 'chat'\): with pools"
    ):
        ray_service(_with_deploy(**{key: value}))


def test_pools_without_ray_are_refused() -> None:
    with pytest.raises(ValueError, match=r"models\[0\]\.pools .* or render it with --ray"):
        render_fleet(parse_fleet_config(FLEET), RenderOptions())
