"""The rendered manifests against real processes: each Deployment's pod is a `fleetserve
serve` run with the Deployment's own arguments on its ConfigMap's fleet file; a real
Prometheus scrapes them with the scrape job the ServiceMonitor implies. Then the
ScaledObject's exact query rises while the queue fills, the Deployment's probe paths
answer 200, every Grafana panel's PromQL runs and returns data, and a SIGTERM'd pod
drains and exits within the grace period the Deployment gives it.

Engine steps are paced (FLEETSERVE_DEBUG_STEP_DELAY_S) and one request runs at a time, so
requests wait; nothing here asserts speed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from server_proc import ServerProc, metric, scrape, start_prometheus, stop_process, wait_until

from fleetserve.deploy import grafana
from fleetserve.deploy.k8s import RenderOptions, render_fleet
from fleetserve.deploy.monitoring import ScrapeTarget, implied_scrape_config
from fleetserve.serve.config.fleet_config import parse_fleet_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary"),
]
TESTS_DIR = Path(__file__).resolve().parent.parent
STEP_DELAY_S = "0.05"


def fleet(model_path: str) -> dict[str, Any]:
    return {
        "models": [
            {"name": "tiny", "model": model_path,
             "engine": {"max_num_seqs": 1, "num_threads": 1, "max_model_len": 512},
             "deploy": {"pool": "spot", "min_replicas": 0, "target_queue_depth": 4,
                        "drain_timeout_s": 2}},
            {"name": "clf", "kind": "custom", "handler": "fleet_handlers:Classifier",
             "options": {"labels": ["even", "odd"]},
             "batching": {"max_batch_size": 4, "batch_wait_timeout_s": 0.01}},
        ],
        "classes": {"interactive": {"priority": 0, "max_waiting": 64},
                    "batch": {"priority": 10, "max_waiting": 1}},
        "default_class": "interactive",
    }  # fmt: skip


def find(objs: list[dict[str, Any]], kind: str, model: str, **meta: str) -> dict[str, Any]:
    (obj,) = [
        o
        for o in objs
        if o["kind"] == kind
        and o["metadata"]["labels"].get("fleetserve/model") == model
        and all(o["metadata"]["labels"].get(k) == v for k, v in meta.items())
    ]
    return obj


def pod_args(container: dict[str, Any], config_path: str) -> list[str]:
    """The container's `fleetserve serve` arguments, for a process on 127.0.0.1: the fleet
    file at `config_path`, and ServerProc's own --host/--port."""
    assert container["command"] == ["fleetserve"] and container["args"][0] == "serve"
    args, out = container["args"][1:], []
    i = 0
    while i < len(args):
        if args[i] in ("--host", "--port"):
            i += 2
            continue
        out.append(config_path if i > 0 and args[i - 1] == "--config" else args[i])
        i += 1
    return out


@dataclass
class Stack:
    objs: list[dict[str, Any]]
    servers: dict[str, ServerProc]
    api: str

    def query(self, promql: str) -> dict[str, Any]:
        resp = httpx.get(f"{self.api}/query", params={"query": promql}, timeout=10)
        body: dict[str, Any] = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stack(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("deploy")
    objs = [m.obj for m in render_fleet(parse_fleet_config(fleet(tiny_llama)), RenderOptions())]
    env = {
        "FLEETSERVE_DEBUG_STEP_DELAY_S": STEP_DELAY_S,
        # The pods of the custom model import its handler from the tests folder.
        "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p),
    }  # fmt: skip
    servers: dict[str, ServerProc] = {}
    targets = []
    prom: subprocess.Popen[bytes] | None = None
    try:
        for model in ("tiny", "clf"):
            dep = find(objs, "Deployment", model)
            config_map = find(objs, "ConfigMap", model)
            path = folder / f"{model}.yaml"
            path.write_text(config_map["data"]["fleet.yaml"])
            (container,) = dep["spec"]["template"]["spec"]["containers"]
            servers[model] = ServerProc(None, *pod_args(container, str(path)), env=env)
            service = find(objs, "Service", model, **{"fleetserve/service": "pods"})
            targets.append(
                ScrapeTarget(
                    address=f"127.0.0.1:{servers[model].port}",
                    pod_name=f"{dep['metadata']['name']}-0",
                    service=service["metadata"]["name"],
                    pod_labels=dep["spec"]["template"]["metadata"]["labels"],
                )
            )
        for srv in servers.values():
            srv.wait_ready()
        (monitor,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
        job = implied_scrape_config(monitor, targets, interval="1s")
        config = {"global": {"scrape_timeout": "1s"}, "scrape_configs": [job]}
        prom, api = start_prometheus(yaml.safe_dump(config), folder)
        st = Stack(objs, servers, api)

        def all_up() -> bool:
            try:
                result = st.query("up == 1")["result"]
            except (httpx.HTTPError, ValueError):
                return False
            return len(result) == len(targets)

        assert wait_until(all_up, timeout_s=60, interval_s=0.5)
        yield st
    finally:
        if prom is not None:
            stop_process(prom)
        for srv in servers.values():
            srv.stop()


def _complete(url: str, i: int, cls: str, max_tokens: int, codes: list[int]) -> None:
    body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    resp = httpx.post(
        f"{url}/v1/completions", json=body, headers={"X-Fleetserve-Class": cls}, timeout=120
    )
    codes.append(resp.status_code)


def test_scaled_object_query_rises_with_the_queue(stack: Stack) -> None:
    so = find(stack.objs, "ScaledObject", "tiny")
    query = so["spec"]["triggers"][0]["metadata"]["query"]

    def value() -> float | None:
        result = stack.query(query)["result"]
        assert len(result) <= 1, result  # a sum is one sample (or none before a scrape)
        return float(result[0]["value"][1]) if result else None

    assert wait_until(lambda: value() == 0.0, timeout_s=30, interval_s=0.5)
    url, codes = stack.servers["tiny"].url, []
    flood = [
        threading.Thread(target=_complete, args=(url, i, "interactive", 20, codes))
        for i in range(6)
    ]
    for t in flood:
        t.start()
    seen: list[float] = []

    def risen() -> bool:
        v = value()
        seen.append(v if v is not None else -1.0)
        return v is not None and v >= 3

    try:
        assert wait_until(risen, timeout_s=30, interval_s=0.25), seen
    finally:
        for t in flood:
            t.join(120)
    assert codes == [200] * 6
    # The series falls back once the queue is empty.
    assert wait_until(lambda: value() == 0.0, timeout_s=30, interval_s=0.5)
    assert max(seen) <= len(flood)  # never more than were sent


def test_probe_paths_answer_200(stack: Stack) -> None:
    for model, srv in stack.servers.items():
        dep = find(stack.objs, "Deployment", model)
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
        for probe in probes:
            assert probe["httpGet"]["port"] == container["ports"][0]["name"]
            resp = httpx.get(srv.url + probe["httpGet"]["path"], timeout=5)
            assert resp.status_code == 200, (model, probe, resp.text)


def _metric_names(url: str) -> set[str]:
    names: set[str] = set()
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if m := re.match(r"# TYPE (\S+) (\w+)", line):
            names.add(m[1])
            if m[2] == "histogram":
                names |= {m[1] + s for s in ("_bucket", "_sum", "_count")}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_dashboard_query_runs_and_returns_data(stack: Stack) -> None:
    # Traffic for every panel: completions of both classes (a second batch request while
    # the queue of one is full is shed), and predictions for the custom model's batcher.
    url, codes = stack.servers["tiny"].url, []
    threads = [threading.Thread(target=_complete, args=(url, i, "interactive", 8, codes))
               for i in range(2)]  # fmt: skip
    threads += [threading.Thread(target=_complete, args=(url, i, "batch", 4, codes))
                for i in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert 503 in codes and 200 in codes, codes
    clf = stack.servers["clf"].url
    for i in range(3):
        body = {"instances": [{"text": "x" * j} for j in range(i + 1)]}
        assert httpx.post(f"{clf}/v1/models/clf:predict", json=body, timeout=30).status_code == 200

    exported = set().union(*(_metric_names(s.url) for s in stack.servers.values()))
    board = grafana.dashboard()
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 15
    for expr in exprs:
        used = set(re.findall(r"fleetserve:[a-zA-Z0-9_:]+", expr))
        assert used <= exported, (expr, used - exported)
        assert used or expr.startswith("sum by (fleetserve_model, fleetserve_pool) (up{"), expr
    substituted = {
        e: e.replace("$__rate_interval", "1m").replace("$namespace", ".*")
        .replace("$model", ".*").replace("$class", ".*")
        for e in exprs if not e.startswith("label_values(")
    }  # fmt: skip

    def all_have_data() -> bool:
        return all(stack.query(q)["result"] for q in substituted.values())

    ok = wait_until(all_have_data, timeout_s=30, interval_s=1.0)
    assert ok, [e for e, q in substituted.items() if not stack.query(q)["result"]]
    # The HTTP panel's series: by route template (not the raw path) and status class.
    (http,) = [p for p in board["panels"] if p["title"].startswith("HTTP requests")]
    # A series newly born (the 5xx one, from the shed request) needs two scrapes before a
    # rate() sees it, so wait for every wanted one rather than reading once.
    want = {("/v1/completions", "2xx"), ("/v1/completions", "5xx"),
            ("/v1/models/{name}:predict", "2xx")}  # fmt: skip
    got: set[tuple[str, str]] = set()

    def http_series() -> bool:
        series = stack.query(substituted[http["targets"][0]["expr"]])["result"]
        got.clear()
        got.update((s["metric"]["route"], s["metric"]["status_class"]) for s in series)
        return want <= got

    assert wait_until(http_series, timeout_s=30, interval_s=1.0), got
    # Variables: label_values(metric{...}, label) is Grafana's; its series query must work.
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            m = re.match(r"label_values\((.*), (\w+)\)$", v["query"]["query"])
            assert m, v
            series = m[1].replace("$namespace", ".*").replace("$model", ".*")
            values = {s["metric"].get(m[2]) for s in stack.query(series)["result"]}
            assert values - {None}, (v["name"], values)
    assert {"tiny", "clf"} <= {
        s["metric"]["model_name"] for s in stack.query("fleetserve:num_requests_waiting")["result"]
    }


def test_sigterm_drain_fits_the_grace_period(stack: Stack) -> None:
    """Last in the module: it stops the generate pod. A request longer than the drain
    budget is in flight; after SIGTERM the pod leaves readiness at once, waits out
    --drain-timeout, aborts the request and exits 0 before the kubelet would SIGKILL it."""
    srv = stack.servers["tiny"]
    spec = find(stack.objs, "Deployment", "tiny")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    budget = spec["terminationGracePeriodSeconds"] - pre_stop  # SIGTERM comes after preStop
    drain = float(container["args"][container["args"].index("--drain-timeout") + 1])
    codes: list[int] = []
    long = threading.Thread(target=_complete, args=(srv.url, 0, "interactive", 400, codes))
    long.start()
    running = "fleetserve:num_requests_running"
    assert wait_until(lambda: metric(scrape(srv.url), running, model_name="tiny") == 1, 30)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: httpx.get(f"{srv.url}/ready", timeout=2).status_code == 503, 5)
    code = srv.proc.wait(budget)
    elapsed = time.monotonic() - start
    long.join(30)
    assert code == 0 and drain - 0.5 <= elapsed <= budget, (code, elapsed, budget)
    assert codes, "the request got no answer"
