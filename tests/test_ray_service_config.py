"""The RayService of `fleetserve deploy k8s --ray`, as KubeRay runs it, on a simulated
cluster: a head with no CPUs and one node per rendered worker group offering that group's
Ray resources, plus a decoy node with CPUs only. The rendered `serveConfigV2` is applied
the way KubeRay applies it (Serve's controller builds the application from the config,
calling `build_app_from_args` with the fleet file), with the API key in the cluster's
environment as the Secret would put it. Each model's replicas must land on its own
group's node, never on the decoy, and the fleet must answer through Serve's proxy; a
model's pools, each on its capacity's group (spot / on-demand). Both fleets' groups are
nodes of one cluster (started once for the module): each test deploys its fleet and
deletes it; a replica must land on a node of its own group, never on the other fleet's
groups' nodes that lack its resources, nor on the decoy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import yaml

from fleetserve.deploy.k8s import RenderOptions, render_fleet
from fleetserve.deploy.kuberay import RaySettings
from fleetserve.serve.config.fleet_config import parse_fleet_config
from ray_cluster import ray_cluster, replica_nodes, wait_healthy

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

KEY = "ray-service-key"


def fleet(model: str) -> dict[str, Any]:
    return {
        "models": [
            {"name": "tiny", "model": model,
             "engine": {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 256},
             "deploy": {"cpu": "1", "pool": "spot", "min_replicas": 1, "max_replicas": 1}},
            {"name": "classifier", "kind": "custom", "handler": "fleet_handlers:Classifier",
             "options": {"labels": ["even", "odd"]},
             "deploy": {"cpu": "1", "min_replicas": 1, "max_replicas": 1}},
        ],
    }  # fmt: skip


def pools_fleet(model: str) -> dict[str, Any]:
    """A model with spot and on-demand pools."""
    return {
        "models": [
            {"name": "tiny", "model": model,
             "engine": {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 256},
             "pools": [{"name": "spot", "capacity": "spot", "replicas": 1},
                       {"name": "base", "capacity": "on_demand", "replicas": 1}],
             "deploy": {"cpu": "1"}},
        ],
    }  # fmt: skip


def render(data: dict[str, Any]) -> tuple[list[dict[str, float]], Any]:
    """(the rendered worker groups' Ray resources, one node each; the serveConfigV2)."""
    from ray.serve.schema import ServeDeploySchema

    objs = render_fleet(parse_fleet_config(data), RenderOptions(ray=RaySettings()))
    (rs,) = [m.obj for m in objs if m.obj["kind"] == "RayService"]
    groups = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["minReplicas"] for g in groups] == [1] * len(groups)  # a pod each
    nodes = [{k: float(v) for k, v in g["resources"].items()} for g in groups]
    config = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    return nodes, config


@pytest.fixture(scope="module")
def cluster(tiny_llama: str) -> Iterator[tuple[Any, str]]:
    """Both fleets' worker groups as nodes, plus a decoy with CPUs only."""
    nodes = render(fleet(tiny_llama))[0] + render(pools_fleet(tiny_llama))[0]
    with ray_cluster(env={"FLEETSERVE_API_KEY": KEY}, worker_resources=[*nodes, {"CPU": 2.0}]) as c:
        yield c


def deployed(config: Any, base_url: str) -> openai.OpenAI:
    """Applies the config as KubeRay does; a client once the fleet answers."""
    from ray.serve.context import _get_global_client

    _get_global_client().deploy_apps(config)
    wait_healthy(base_url)
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_the_rendered_serve_config_runs_each_model_on_its_group(
    cluster: tuple[Any, str], tiny_llama: str
) -> None:
    _, config = render(fleet(tiny_llama))
    _, base_url = cluster
    # Each node by its group's resource ("" for the decoy); the pools fleet's groups
    # offer "fleetserve-tiny" too (the model's resource), plus their capacity.
    node_of = {
        n["NodeID"]: next(iter(k for k in n["Resources"] if k.startswith("fleetserve-")), "")
        for n in ray.nodes()
        if n["Alive"]
    }
    try:
        c = deployed(config, base_url)
        assert {m.id for m in c.models.list().data} == {"tiny", "classifier"}
        out = c.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
        assert [node_of[n] for n in replica_nodes("model-tiny")] == ["fleetserve-tiny"]
        assert [node_of[n] for n in replica_nodes("model-classifier")] == ["fleetserve-classifier"]
    finally:
        serve.delete("fleetserve")


def test_the_pools_of_a_model_run_on_their_capacity_groups(
    cluster: tuple[Any, str], tiny_llama: str
) -> None:
    """A model with spot and on-demand pools: the rendered worker groups (one per capacity)
    as nodes; each pool's replica lands on its own capacity's node."""
    nodes, config = render(pools_fleet(tiny_llama))
    assert len(nodes) == 2
    _, base_url = cluster
    kind_of = {
        n["NodeID"]: next((k for k in ("spot", "on_demand") if k in n["Resources"]), "other")
        for n in ray.nodes()
        if n["Alive"]
    }
    try:
        c = deployed(config, base_url)
        out = c.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 4
        assert [kind_of[n] for n in replica_nodes("model-tiny--spot")] == ["spot"]
        assert [kind_of[n] for n in replica_nodes("model-tiny--base")] == ["on_demand"]
        assert [kind_of[n] for n in replica_nodes("ingress")] == ["on_demand"]
    finally:
        serve.delete("fleetserve")
