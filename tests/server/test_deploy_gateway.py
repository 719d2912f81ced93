"""The rendered gateway against real processes: a model's pod runs its Deployment's own
arguments and ConfigMap, the gateway runs its Deployment's arguments on its ConfigMap's
fleet file, both with the API key the Secret would give them. Only the cluster's DNS is
stood in for: the headless Service's name resolves to the pod's 127.0.0.1 address. Then
the gateway's probe paths answer, a completion through it equals one sent to the pod, a
request without the key is refused, and the gateway reports the model's queue depth
(the series the ScaledObject sums, now scraped from the gateway too)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml
from server_proc import ServerProc, scrape
from test_deploy_prometheus import find, pod_args

from fleetserve.deploy.gateway import GatewaySettings
from fleetserve.deploy.k8s import RenderOptions, render_fleet
from fleetserve.deploy.pods import SecretRef
from fleetserve.serve.fleet_config import parse_fleet_config

pytestmark = pytest.mark.slow
KEY = "gateway-test-key"


def fleet(model_path: str) -> dict[str, Any]:
    return {
        "models": [
            {"name": "tiny", "model": model_path, "routing": "prefix_affinity",
             "engine": {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 512},
             "deploy": {"min_replicas": 1, "drain_timeout_s": 2}},
        ],
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}},
        "default_class": "interactive",
    }  # fmt: skip


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


@pytest.fixture(scope="module")
def stack(
    tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[dict[str, Any]], ServerProc, ServerProc]]:
    folder = tmp_path_factory.mktemp("gateway")
    opts = RenderOptions(gateway=GatewaySettings(replicas=1), api_key=SecretRef("fleet-key"))
    objs = [m.obj for m in render_fleet(parse_fleet_config(fleet(tiny_llama)), opts)]
    env = {"FLEETSERVE_API_KEY": KEY}  # what the Secret's env entry gives each container
    pod_path = folder / "pod.yaml"
    pod_path.write_text(find(objs, "ConfigMap", "tiny")["data"]["fleet.yaml"])
    (pod_container,) = find(objs, "Deployment", "tiny")["spec"]["template"]["spec"]["containers"]
    assert {"name": "FLEETSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "fleet-key", "key": "api-key"}}} in pod_container["env"]  # fmt: skip
    pod = ServerProc(None, *pod_args(pod_container, str(pod_path)), env=env)
    gateway: ServerProc | None = None
    try:
        pod.wait_ready()
        # The cluster's part: the headless Service's DNS name resolves to the pod.
        gw_config = named(objs, "ConfigMap", "fleetserve-gateway-config")
        gw_fleet = yaml.safe_load(gw_config["data"]["fleet.yaml"])
        headless = find(objs, "Service", "tiny", **{"fleetserve/service": "pods"})
        (model,) = gw_fleet["models"]
        port = headless["spec"]["ports"][0]["port"]
        assert model["remote"]["dns"] == f"{headless['metadata']['name']}.fleetserve.svc:{port}"
        model["remote"]["dns"] = f"127.0.0.1:{pod.port}"
        gw_path = folder / "gateway.yaml"
        gw_path.write_text(yaml.safe_dump(gw_fleet))
        gw_dep = named(objs, "Deployment", "fleetserve-gateway")
        (gw_container,) = gw_dep["spec"]["template"]["spec"]["containers"]
        gateway = ServerProc(None, *pod_args(gw_container, str(gw_path)), env=env)
        gateway.wait_ready()
        yield objs, pod, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        pod.stop()


def test_the_rendered_gateway_routes_over_the_pod(
    stack: tuple[list[dict[str, Any]], ServerProc, ServerProc],
) -> None:
    objs, pod, gateway = stack
    gw_dep = named(objs, "Deployment", "fleetserve-gateway")
    (container,) = gw_dep["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert httpx.get(gateway.url + path, timeout=5).status_code == 200, probe

    body = {"model": "tiny", "prompt": "the gateway routes", "max_tokens": 16,
            "temperature": 0.0}  # fmt: skip
    answers = []
    for url in (gateway.url, pod.url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            answers.append(c.completions.create(**body).choices[0].text)
    assert answers[0] == answers[1] and answers[0]
    refused = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 401

    series = scrape(gateway.url, {"Authorization": f"Bearer {KEY}"})
    waiting = [k for k in series if k.startswith("fleetserve:num_requests_waiting{")]
    assert any('model_name="tiny"' in k for k in waiting), waiting
