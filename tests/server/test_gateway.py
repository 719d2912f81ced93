"""A gateway over remote replicas: three `fleetserve serve` processes on 127.0.0.1 stand
in for Kubernetes pods, and a `fleetserve serve --config` gateway routes over them
(`remote: {urls: [...]}`). Streams through the gateway must equal a direct run on a pod,
also when the pod holding them is drained by the gateway's admin API, SIGTERMed (it
answers 503 draining) or killed (-9) mid-stream, and a request for a model whose pods are
at zero waits in the gateway until a pod comes up. Only processes this test started are
signalled, by pid."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from server_proc import ServerProc, free_port, metric, scrape, wait_until
from test_chaos import MAX_TOKENS, STEP_DELAY_S, requests, run_streams

from fleetserve.serve.remote.wire import GENERATE_PATH, LOAD_PATH, MSGPACK

POD_KEY = "pod-secret"
AUTH = {"Authorization": f"Bearer {POD_KEY}"}


def start_pod(tiny_llama: str, port: int | None = None) -> ServerProc:
    """A pod; `port`: one chosen before it starts (a gateway's config already names it)."""
    env = {"FLEETSERVE_DEBUG_STEP_DELAY_S": STEP_DELAY_S}
    at = ["--port", str(port)] if port is not None else []  # the last --port wins
    pod = ServerProc(tiny_llama, "--served-model-name", "tiny", "--api-key", POD_KEY,
                     "--drain-timeout", "2", "--max-num-seqs", "16", *at, env=env)  # fmt: skip
    if port is not None:
        pod.port, pod.url = port, f"http://127.0.0.1:{port}"
    return pod


def gateway_config(tiny_llama: str, remote: str) -> str:
    return f"models:\n  - name: tiny\n    model: {tiny_llama}\n{remote}"


@pytest.fixture(scope="module")
def started(tiny_llama: str, tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """Three pods, the gateway over them and one that follows a DNS name (pods[2]), all
    started at once (each pod's port is chosen before it starts; a gateway waits for its
    pods as it would in a cluster), then waited for."""
    procs = [start_pod(tiny_llama) for _ in range(3)]
    folder = tmp_path_factory.mktemp("gateway")
    urls = ", ".join(f'"{p.url}"' for p in procs)
    (folder / "fleet.yaml").write_text(gateway_config(tiny_llama,
        "    routing: prefix_affinity\n    engine: {max_num_seqs: 16}\n"
        f"    remote: {{urls: [{urls}], poll_interval_s: 0.25, api_key_env: POD_KEY}}\n"))  # fmt: skip
    # `remote: {dns: HOST:PORT}`: an IP literal here (one pod); a headless Service lists
    # every pod.
    (folder / "dns.yaml").write_text(gateway_config(tiny_llama,
        f"    remote: {{dns: '127.0.0.1:{procs[2].port}', refresh_s: 0.5, "
        "api_key_env: POD_KEY}\n"))  # fmt: skip
    env = {"POD_KEY": POD_KEY}
    gateways = [ServerProc(None, "--config", str(folder / f), env=env)
                for f in ("fleet.yaml", "dns.yaml")]  # fmt: skip
    try:
        for p in (*procs, *gateways):
            p.wait_ready()
        yield {"pods": procs, "gateway": gateways[0], "dns_gateway": gateways[1]}
    finally:
        for p in (*gateways, *procs):
            p.stop()


@pytest.fixture(scope="module")
def pods(started: dict[str, Any]) -> list[ServerProc]:
    return started["pods"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def gateway(started: dict[str, Any]) -> ServerProc:
    return started["gateway"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(pods: list[ServerProc]) -> list[dict[str, Any]]:
    """The undisturbed run, directly on a pod: the same requests at once (test_chaos.py
    `reference`)."""
    out = run_streams(pods[0].url, requests(6), api_key=POD_KEY)
    for r in out:
        assert r["finish"] == "length" and r["usage"][1] == MAX_TOKENS, r
    return out


def replicas(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/admin/replicas", timeout=10).json()["data"]


def busy_replica(url: str) -> dict[str, Any]:
    """A ready replica of the gateway that holds requests now (waits for one)."""
    found: list[dict[str, Any]] = []

    def pick() -> bool:
        found[:] = [r for r in replicas(url) if r["state"] == "ready" and r["num_requests"]]
        return bool(found)

    assert wait_until(pick, 30, 0.05), replicas(url)
    return found[0]


def num_served(pods: list[ServerProc]) -> list[float]:
    return [metric(scrape(p.url, AUTH), "fleetserve:request_success_total") for p in pods]


def check_same(got: list[Any], reference: list[dict[str, Any]]) -> None:
    for g, want in zip(got, reference, strict=True):
        assert not isinstance(g, BaseException), g
        assert (g["text"], g["usage"], g["finish"]) == (want["text"], want["usage"], want["finish"])


def test_gateway_lists_the_pods_as_replicas(gateway: ServerProc, pods: list[ServerProc]) -> None:
    rows = replicas(gateway.url)
    assert sorted(r["url"] for r in rows) == sorted(p.url for p in pods)
    assert all(r["pool"] == "remote" and r["pid"] is None for r in rows)
    # Each is ready. A load poll that outlasts its 1 s timeout (a loaded machine) marks its
    # pod unreachable ("starting") until the next poll answers, as it should: so each must be
    # seen ready, not all at one instant.
    seen: set[str] = set()

    def all_seen_ready() -> bool:
        seen.update(r["url"] for r in replicas(gateway.url) if r["state"] == "ready")
        return seen == {p.url for p in pods}

    assert wait_until(all_seen_ready, 30, 0.05), replicas(gateway.url)


def test_routes_over_pods_with_prefix_affinity(gateway: ServerProc, pods: list[ServerProc]) -> None:
    before = num_served(pods)
    prompt = "a long shared system prompt that spans several KV blocks " * 4
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    for _ in range(4):
        run_streams(gateway.url, [body])
    after = num_served(pods)
    grew = [a - b for a, b in zip(after, before, strict=True)]
    assert sorted(grew) == [0, 0, 4], grew  # one prompt, one pod
    # Distinct prompts at once spread over the pods by load.
    bodies = [{**b, "max_tokens": 24} for b in requests(6)]
    got = run_streams(gateway.url, bodies)
    assert all(not isinstance(g, BaseException) for g in got), got
    spread = [a - b for a, b in zip(num_served(pods), after, strict=True)]
    assert sum(spread) == 6 and sum(1 for n in spread if n) >= 2, spread


def test_streams_equal_a_direct_run(gateway: ServerProc, reference: list[dict[str, Any]]) -> None:
    check_same(run_streams(gateway.url, requests(6)), reference)


def _generate_status(pod: ServerProc, **over: Any) -> int:
    body = {"model": "tiny", "request_id": "probe", "prompt_token_ids": [1, 2, 3],
            "params": {"max_tokens": 2, "temperature": 0.0}, **over}  # fmt: skip
    try:
        r = httpx.post(f"{pod.url}{GENERATE_PATH}", json=body, headers=AUTH, timeout=10)
    except httpx.HTTPError:
        return 0
    return r.status_code


def load_of(pod: ServerProc) -> dict[str, Any]:
    r = httpx.get(f"{pod.url}{LOAD_PATH}", headers=AUTH, timeout=10)
    return r.json()  # type: ignore[no-any-return]


def test_internal_api_refuses_bad_requests(pods: list[ServerProc]) -> None:
    pod = pods[0]
    url = f"{pod.url}{GENERATE_PATH}"
    good = {"model": "tiny", "request_id": "r1", "prompt_token_ids": [5, 6, 7],
            "params": {"max_tokens": 3, "temperature": 0.0}}  # fmt: skip
    assert httpx.post(url, json=good, timeout=10).status_code == 401  # the API key is required
    assert httpx.get(f"{pod.url}{LOAD_PATH}", timeout=10).status_code == 401
    load = httpx.get(f"{pod.url}{LOAD_PATH}", params={"model": "tiny"}, headers=AUTH, timeout=10)
    assert load.status_code == 200 and load.json()["healthy"] is True
    ok = httpx.post(url, content=msgspec.msgpack.encode(good),
                    headers={**AUTH, "Content-Type": MSGPACK}, timeout=30)  # fmt: skip
    assert ok.status_code == 200 and ok.content  # frames

    # A gateway that leaves aborts the request on the pod (500 tokens would take 10 s).
    long = {**good, "params": {"max_tokens": 500, "ignore_eos": True}}
    with httpx.stream("POST", url, json=long, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        next(chunks)
        assert load_of(pod)["num_outstanding_requests"] == 1
        del chunks
    assert wait_until(lambda: load_of(pod)["num_outstanding_requests"] == 0, 5)

    def refused(body: Any, status: int, param: str | None = None, **kw: Any) -> None:
        sent = {"headers": AUTH, **({} if "content" in kw else {"json": body}), **kw}
        r = httpx.post(url, timeout=10, **sent)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param, err

    refused(good, 415, content=b"x", headers={**AUTH, "Content-Type": "text/plain"})
    refused(None, 400, content=b"\xc1", headers={**AUTH, "Content-Type": MSGPACK})
    refused({k: v for k, v in good.items() if k != "params"}, 400)
    refused({**good, "surprise": 1}, 400)
    refused({**good, "params": {"top_p": 2.0}}, 400, "top_p")
    refused({**good, "params": {"n": "two"}}, 400, "params.n")
    refused({**good, "prompt_token_ids": []}, 400)
    refused({**good, "prompt_token_ids": [10**9]}, 400)
    refused({**good, "model": "nope"}, 404, "model")
    resume = {"request_id": "r1", "prompt": None, "prompt_token_ids": [9],
              "outputs": [{"index": 0, "text": "", "token_ids": [1]}]}  # fmt: skip
    refused({**good, "resume": resume}, 400)  # not this request's prompt
    resume["prompt_token_ids"] = good["prompt_token_ids"]
    resume["outputs"] = [{"index": 0, "text": "", "token_ids": [1, 2, 3]}]
    refused({**good, "resume": resume}, 400)  # already at max_tokens, yet not finished


def test_gateway_follows_a_dns_name(
    started: dict[str, Any], pods: list[ServerProc], reference: list[dict[str, Any]]
) -> None:
    """`remote: {dns: HOST:PORT}`: the pool starts empty and follows what the name
    resolves to (an IP literal here: one pod; a headless Service lists every pod)."""
    srv = started["dns_gateway"]
    assert [r["url"] for r in replicas(srv.url)] == [pods[2].url]
    check_same(run_streams(srv.url, requests(1)), reference[:1])


def test_admin_drain_moves_streams(gateway: ServerProc, reference: list[dict[str, Any]]) -> None:
    moved = metric(scrape(gateway.url), "fleetserve:request_migrations_total")

    def drain(url: str) -> None:
        victim = busy_replica(url)
        r = httpx.post(f"{url}/admin/replicas/{victim['id']}/drain", json={"timeout_s": 0})
        assert r.status_code == 202, r.text

    check_same(run_streams(gateway.url, requests(6), during=drain), reference)
    assert metric(scrape(gateway.url), "fleetserve:request_migrations_total") > moved
    # The pod itself is fine: a new replica takes its address again.
    assert wait_until(lambda: sum(r["state"] == "ready" for r in replicas(gateway.url)) == 3, 30), (
        replicas(gateway.url)
    )


def victim_pod(gateway: ServerProc, pods: list[ServerProc]) -> ServerProc:
    url = busy_replica(gateway.url)["url"]
    return next(p for p in pods if p.url == url)


def test_pod_sigterm_mid_stream(
    gateway: ServerProc, pods: list[ServerProc], reference: list[dict[str, Any]]
) -> None:
    drained = metric(scrape(gateway.url), "fleetserve:request_migrations_total", reason="drained")
    hit: list[ServerProc] = []

    def terminate(url: str) -> None:
        pod = victim_pod(gateway, pods)
        hit.append(pod)
        os.kill(pod.proc.pid, signal.SIGTERM)
        # While it drains it refuses new work with 503 draining.
        wait_until(lambda: pod.proc.poll() is not None or _generate_status(pod) == 503, 10)

    check_same(run_streams(gateway.url, requests(6), during=terminate), reference)
    assert hit[0].proc.wait(30) == 0  # it drained and exited cleanly
    # Its 2 s drain budget is shorter than the streams: they moved (not finished there).
    moved = metric(scrape(gateway.url), "fleetserve:request_migrations_total", reason="drained")
    assert moved > drained


def test_pod_killed_mid_stream(
    gateway: ServerProc, pods: list[ServerProc], reference: list[dict[str, Any]]
) -> None:
    died = metric(scrape(gateway.url), "fleetserve:request_migrations_total", reason="died")

    def kill(url: str) -> None:
        os.kill(victim_pod(gateway, pods).proc.pid, signal.SIGKILL)

    check_same(run_streams(gateway.url, requests(6), during=kill), reference)
    assert metric(scrape(gateway.url), "fleetserve:request_migrations_total", reason="died") > died


def test_a_request_waits_for_a_pod_to_come_up(
    tiny_llama: str, reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Scale from zero: the gateway starts with its model's pod down and serves (/live; not
    /ready, which says a model has no pod). A request waits in its queue, counted in the
    gateway's queue depth (what KEDA reads to start a pod); then the pod starts and the
    request completes as on an undisturbed pod."""
    port = free_port()
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"models:\n  - name: tiny\n    model: {tiny_llama}\n"
        "    resilience: {migration_wait_s: 200}\n"  # a loaded machine may start pods slowly
        f"    remote: {{urls: ['http://127.0.0.1:{port}'], poll_interval_s: 0.25, "
        "api_key_env: POD_KEY}\n"
    )
    gateway = ServerProc(None, "--config", str(config), env={"POD_KEY": POD_KEY})
    pod: ServerProc | None = None

    def status(path: str) -> int:
        assert gateway.proc.poll() is None, gateway.output()
        try:
            return httpx.get(gateway.url + path, timeout=5).status_code
        except httpx.HTTPError:
            return 0

    waiting = "fleetserve:num_requests_waiting"
    try:
        assert wait_until(lambda: status("/live") == 200, 120, 0.2), gateway.output()
        assert status("/ready") == 503
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(run_streams, gateway.url, requests(1))
            assert wait_until(lambda: metric(scrape(gateway.url), waiting, model_name="tiny") == 1,
                              30), scrape(gateway.url)  # fmt: skip
            assert not sent.done()
            pod = start_pod(tiny_llama, port)
            pod.wait_ready()
            got = sent.result(timeout=180)
        check_same(got, reference[:1])
        assert metric(scrape(gateway.url), waiting, model_name="tiny") == 0
        assert status("/ready") == 200
    finally:
        gateway.stop()
        if pod is not None:
            pod.stop()


def test_a_dns_name_that_lists_no_pod_yet(
    tiny_llama: str,
    pods: list[ServerProc],
    reference: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool at zero behind `remote: {dns}`: the headless Service's name does not resolve
    (no ready pod). The model starts with no replica, a request waits; once the name lists
    a pod, the next refresh adds it and the request completes as on an undisturbed pod.
    In-process: the gateway's GenerateService with the resolver stood in for."""
    from fleetserve.entrypoints.openai.protocol import CompletionRequest
    from fleetserve.entrypoints.openai.serving_completion import completion_inputs
    from fleetserve.metrics import ServerMetrics
    from fleetserve.serve.config.fleet_config import parse_fleet_config
    from fleetserve.serve.remote.targets import RemoteTargets
    from fleetserve.serve.services.service_registry import build_registry

    listed: list[str] = []

    async def resolve(self: RemoteTargets) -> list[str]:
        if not listed:
            raise OSError("Name or service not known")  # what a Service without pods gives
        return list(listed)

    monkeypatch.setattr(RemoteTargets, "resolve", resolve)
    monkeypatch.setenv("POD_KEY", POD_KEY)
    remote = {"dns": "fleetserve-tiny-pods.llm.svc:8000", "refresh_s": 0.2,
              "poll_interval_s": 0.25, "api_key_env": "POD_KEY"}  # fmt: skip
    fleet = parse_fleet_config(
        {"models": [{"name": "tiny", "model": tiny_llama, "remote": remote}]}
    )
    service: Any = build_registry(fleet, ServerMetrics()).get("tiny", "generate")
    body = requests(1)[0]
    prompts, params = completion_inputs(CompletionRequest(model="tiny", **body))

    async def main() -> str:
        await service.start(60)
        try:
            sent = asyncio.create_task(service.admit("r0", prompts, lambda: copy.copy(params)))
            await asyncio.sleep(1.0)  # several refreshes that find nothing
            assert not sent.done() and service.num_waiting("default") == 1
            assert not service.is_ready and service.dead_reason is None  # waiting, not dead
            # A pod the earlier tests did not SIGTERM or kill (they take one each).
            listed.append(next(p.url for p in pods if p.proc.poll() is None))
            (stream,) = await asyncio.wait_for(sent, 60)
            async for _ in stream:  # deltas; the state folds them into the whole answer
                pass
            return str(stream.state.fold.output().outputs[0].text)
        finally:
            await service.shutdown()

    assert asyncio.run(main()) == reference[0]["text"]
