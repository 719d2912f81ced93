"""The rendered gateway against real processes: a model's pod runs its Deployment's own
arguments and ConfigMap, the gateway runs its Deployment's arguments on its ConfigMap's
fleet file, both with the API key the Secret would give them, and a real Prometheus
scrapes both with the job the ServiceMonitor implies (the Secret's key as bearer token).
Only the cluster's DNS is stood in for (the headless Service's name resolves to the pod's
127.0.0.1 address) and so is KEDA (the test starts the pod when the ScaledObject's query
says it would).

The model's pool scales to zero (min_replicas 0): the gateway starts without its pod, a
request waits in the gateway, the ScaledObject's exact query returns its queue depth from
the gateway's series (what activates the Deployment), the pod starts and the request
completes with the pod's own answer. Then the gateway's probe paths answer, a completion
through it equals one sent to the pod, and a request without the key is refused."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import yaml
from server_proc import ServerProc, free_port, scrape, start_prometheus, stop_process, wait_until
from test_deploy_prometheus import find, pod_args

from fleetserve.deploy.gateway import GatewaySettings
from fleetserve.deploy.k8s import RenderOptions, render_fleet
from fleetserve.deploy.monitoring import ScrapeTarget, implied_scrape_config
from fleetserve.deploy.pods import SecretRef
from fleetserve.serve.config.fleet_config import parse_fleet_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary"),
]
KEY = "gateway-test-key"
SECRET = SecretRef("fleet-key")
BODY = {"model": "tiny", "prompt": "the gateway routes", "max_tokens": 16, "temperature": 0.0}


def fleet(model_path: str) -> dict[str, Any]:
    return {
        "models": [
            {"name": "tiny", "model": model_path, "routing": "prefix_affinity",
             "engine": {"max_num_seqs": 4, "num_threads": 1, "max_model_len": 512},
             # A loaded CI machine may take a while to start the pod.
             "resilience": {"migration_wait_s": 200},
             "deploy": {"min_replicas": 0, "drain_timeout_s": 2}},
        ],
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}},
        "default_class": "interactive",
    }  # fmt: skip


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


@dataclass
class Stack:
    objs: list[dict[str, Any]]
    gateway: ServerProc
    api: str  # Prometheus' HTTP API
    pod_args: list[str]
    pod_port: int
    pod: ServerProc | None = None

    def start_pod(self) -> ServerProc:
        """What KEDA does once the query passes the activation threshold (idempotent)."""
        if self.pod is None:
            # The Deployment's arguments; the port the headless Service names (the last
            # --port wins over ServerProc's own).
            pod = ServerProc(None, *self.pod_args, "--port", str(self.pod_port),
                             env={"FLEETSERVE_API_KEY": KEY})  # fmt: skip
            pod.port, pod.url = self.pod_port, f"http://127.0.0.1:{self.pod_port}"
            self.pod = pod
            pod.wait_ready()
        return self.pod

    def query(self, promql: str) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.api}/query", params={"query": promql}, timeout=10)
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]["result"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stack(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("gateway")
    opts = RenderOptions(gateway=GatewaySettings(replicas=1), api_key=SECRET)
    objs = [m.obj for m in render_fleet(parse_fleet_config(fleet(tiny_llama)), opts)]
    env = {"FLEETSERVE_API_KEY": KEY}  # what the Secret's env entry gives each container
    pod_path = folder / "pod.yaml"
    pod_path.write_text(find(objs, "ConfigMap", "tiny")["data"]["fleet.yaml"])
    pod_dep = find(objs, "Deployment", "tiny")
    (pod_container,) = pod_dep["spec"]["template"]["spec"]["containers"]
    assert SECRET.env() in pod_container["env"]
    pod_port = free_port()
    # The cluster's part: the headless Service's DNS name resolves to the pod's address.
    gw_config = named(objs, "ConfigMap", "fleetserve-gateway-config")
    gw_fleet = yaml.safe_load(gw_config["data"]["fleet.yaml"])
    headless = find(objs, "Service", "tiny", **{"fleetserve/service": "pods"})
    (model,) = gw_fleet["models"]
    port = headless["spec"]["ports"][0]["port"]
    assert model["remote"]["dns"] == f"{headless['metadata']['name']}.fleetserve.svc:{port}"
    model["remote"]["dns"] = f"127.0.0.1:{pod_port}"
    gw_path = folder / "gateway.yaml"
    gw_path.write_text(yaml.safe_dump(gw_fleet))
    gw_dep = named(objs, "Deployment", "fleetserve-gateway")
    (gw_container,) = gw_dep["spec"]["template"]["spec"]["containers"]
    gateway = ServerProc(None, *pod_args(gw_container, str(gw_path)), env=env)
    prom: subprocess.Popen[bytes] | None = None
    st: Stack | None = None
    try:
        startup = gw_container["startupProbe"]["httpGet"]["path"]
        ok = wait_until(lambda: _status(gateway, startup) == 200, 120, 0.2)
        assert ok, gateway.output()
        (monitor,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
        targets = [
            ScrapeTarget(f"127.0.0.1:{srv_port}", f"{dep['metadata']['name']}-0",
                         service, dep["spec"]["template"]["metadata"]["labels"])
            for srv_port, dep, service in (
                (gateway.port, gw_dep, "fleetserve-gateway"),
                (pod_port, pod_dep, headless["metadata"]["name"]),
            )
        ]  # fmt: skip
        secrets = {(SECRET.name, SECRET.key): KEY}
        job = implied_scrape_config(monitor, targets, interval="1s", secrets=secrets)
        config = {"global": {"scrape_timeout": "1s"}, "scrape_configs": [job]}
        prom, api = start_prometheus(yaml.safe_dump(config), folder)
        st = Stack(objs, gateway, api, pod_args(pod_container, str(pod_path)), pod_port)

        def answers() -> bool:
            try:
                return bool(st.query("up"))
            except (httpx.HTTPError, ValueError):
                return False

        assert wait_until(answers, 60, 0.5), "Prometheus did not come up"
        yield st
    finally:
        if prom is not None:
            stop_process(prom)
        gateway.stop()
        if st is not None and st.pod is not None:
            st.pod.stop()


def _status(srv: ServerProc, path: str) -> int:
    assert srv.proc.poll() is None, srv.output()
    try:
        return httpx.get(srv.url + path, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _complete(url: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=200) as c:
        return c.completions.create(**BODY).choices[0].text  # type: ignore[no-any-return]


def test_a_pool_at_zero_wakes_on_the_gateways_queue(stack: Stack) -> None:
    assert stack.pod is None, "runs first: the pool is at zero"
    so = find(stack.objs, "ScaledObject", "tiny")
    assert so["spec"]["minReplicaCount"] == 0
    trigger = so["spec"]["triggers"][0]["metadata"]
    activation = float(trigger["activationThreshold"])

    def depth() -> float | None:
        result = stack.query(trigger["query"])
        assert len(result) <= 1, result  # a sum: one sample (none before a scrape)
        return float(result[0]["value"][1]) if result else None

    # The gateway is scraped (with the key) while no pod is: the query reads 0, not nothing.
    assert wait_until(lambda: depth() == 0.0, 60, 0.5), stack.query("up")
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(_complete, stack.gateway.url)
        seen: list[float | None] = []

        def active() -> bool:
            seen.append(depth())
            return seen[-1] is not None and seen[-1] > activation

        assert wait_until(active, 60, 0.5), seen  # KEDA would activate the Deployment now
        assert not sent.done() and seen[-1] == 1.0
        pod = stack.start_pod()
        answer = sent.result(timeout=200)
    assert answer and answer == _complete(pod.url)
    assert wait_until(lambda: depth() == 0.0, 60, 0.5)


def test_the_rendered_gateway_routes_over_the_pod(stack: Stack) -> None:
    pod, gateway = stack.start_pod(), stack.gateway
    gw_dep = named(stack.objs, "Deployment", "fleetserve-gateway")
    (container,) = gw_dep["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert _status(gateway, path) == 200, probe

    assert _complete(gateway.url) == _complete(pod.url)
    refused = httpx.post(f"{gateway.url}/v1/completions", json=BODY, timeout=30)
    assert refused.status_code == 401

    series = scrape(gateway.url, {"Authorization": f"Bearer {KEY}"})
    waiting = [k for k in series if k.startswith("fleetserve:num_requests_waiting{")]
    assert any('model_name="tiny"' in k for k in waiting), waiting
    # Both targets are up for Prometheus: the scrape carries the key.
    assert wait_until(lambda: len(stack.query("up == 1")) == 2, 30, 0.5), stack.query("up")
