"""A small simulated Ray cluster for the Ray Serve tests: a head and two worker nodes in
this machine (ray.cluster_utils.Cluster), with Serve's HTTP proxy on a free port."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from fleetserve.bench.local_server import free_port

TESTS_DIR = str(Path(__file__).resolve().parent)
SRC_DIR = str(Path(__file__).resolve().parent.parent / "src")
# Small object stores: the tests move tokens and vectors, not tensors.
OBJECT_STORE_BYTES = 80 * 2**20


def _start_head(cluster_type: Any, head_node_args: dict[str, Any]) -> Any:
    """The simulated cluster with its head started; one more try when the head's GCS
    never wrote its port file (the slow stage once timed out so, in a test process that
    had run another module's cluster before: the GCS child left no log at all). What the
    failed try started is killed: only this process's own new children."""
    import psutil

    for attempt in (1, 2):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            return cluster_type(initialize_head=True, head_node_args=head_node_args)
        except RuntimeError as e:
            if attempt == 2 or "Timed out waiting for file" not in str(e):
                raise
            for p in psutil.Process().children(recursive=True):
                if p.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
    raise AssertionError("unreachable")


@contextmanager
def ray_cluster(
    num_workers: int = 2,
    worker_cpus: int = 2,
    env: dict[str, str] | None = None,
    worker_resources: Sequence[Mapping[str, float]] = (),
    worker_labels: Sequence[Mapping[str, str]] = (),
    worker_env: Sequence[Mapping[str, str]] = (),
) -> Iterator[tuple[Any, str]]:
    """(cluster, base_url of Serve's proxy); everything is shut down on exit. `env` is set
    for the cluster's processes (engines read FLEETSERVE_DEBUG_STEP_DELAY_S);
    `worker_resources[i]` / `worker_labels[i]`: the Ray resources (custom ones, e.g.
    {"spot": 1}, and "CPU" to override `worker_cpus`) and node labels of worker i, as a
    KubeRay worker group's pod offers them; `worker_env[i]`: environment variables of
    worker i's processes only, over `env` (a slow node: FLEETSERVE_DEBUG_STEP_DELAY_S);
    there are max(num_workers, len(...)) workers."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    # Workers are processes of the raylets started here: they import fleetserve (and the
    # tests' custom handler) from the same paths as this process.
    paths = [SRC_DIR, TESTS_DIR, os.environ.get("PYTHONPATH", "")]
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    os.environ.update(env or {})
    cluster = _start_head(
        Cluster,
        # The head runs Serve's controller and proxy and the ingress (0 CPUs each); the
        # model replicas need the workers' CPUs, as on a real cluster.
        {
            "num_cpus": 0,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
            # Every port of its own (the head's dashboard agent defaults to a fixed one):
            # two test modules' clusters run side by side on the two xdist workers.
            "dashboard_agent_listen_port": free_port(),
        },
    )
    try:
        num_nodes = max(num_workers, len(worker_resources), len(worker_labels), len(worker_env))
        for i in range(num_nodes):
            resources = dict(worker_resources[i]) if i < len(worker_resources) else {}
            labels = dict(worker_labels[i]) if i < len(worker_labels) else {}
            cpus = int(resources.pop("CPU", worker_cpus))
            # A node's raylet copies this process's environment when it starts, and its
            # workers (and their engine processes) inherit the raylet's.
            node_env = dict(worker_env[i]) if i < len(worker_env) else {}
            before = {k: os.environ.get(k) for k in node_env}
            os.environ.update(node_env)
            try:
                add_worker(cluster, cpus, resources, labels)
            finally:
                for k, v in before.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        # One proxy, on the head: these nodes share one host, and a proxy per node would
        # share the port, so removing a node would also drop the connections of its proxy.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            os.environ.clear()
            os.environ.update(saved)


def add_worker(
    cluster: Any,
    num_cpus: int,
    resources: Mapping[str, float],
    labels: Mapping[str, str] | None = None,
) -> Any:
    """A worker node with `num_cpus`, custom `resources` and node `labels`; returns it
    (for remove_node)."""
    return cluster.add_node(
        num_cpus=num_cpus,
        resources=dict(resources),
        labels=dict(labels or {}),
        object_store_memory=OBJECT_STORE_BYTES,
    )


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def wait_healthy(base_url: str, timeout_s: float = 300.0) -> None:
    def ok() -> bool:
        try:
            return httpx.get(f"{base_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ok, timeout_s, "/health to answer 200")


def replica_actors(deployment: str, app: str = "fleetserve") -> dict[str, str]:
    """Actor id -> node id of the deployment's live replicas."""
    from ray._private.state import state

    name = f"ServeReplica:{app}:{deployment}"
    return {
        a["ActorID"]: a["Address"]["NodeID"]
        for a in state.actor_table(None).values()
        if a["ActorClassName"] == name and a["State"] == "ALIVE"
    }


def replica_pids(deployment: str, app: str = "fleetserve") -> dict[str, int]:
    """Actor id -> process id of the deployment's live replicas."""
    from ray._private.state import state

    name = f"ServeReplica:{app}:{deployment}"
    return {
        a["ActorID"]: int(a["Pid"])
        for a in state.actor_table(None).values()
        if a["ActorClassName"] == name and a["State"] == "ALIVE"
    }


def replica_nodes(deployment: str, app: str = "fleetserve") -> list[str]:
    """Node ids of the deployment's live replica actors. (The GCS's actor table: the public
    state API needs the dashboard, which these small clusters leave out.)"""
    from ray._private.state import state

    name = f"ServeReplica:{app}:{deployment}"
    return [
        a["Address"]["NodeID"]
        for a in state.actor_table(None).values()
        if a["ActorClassName"] == name and a["State"] == "ALIVE"
    ]


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=10).text


def engine_core_pid(actor_pid: int) -> int:
    """The engine process a generate replica's actor started (a child running core_proc)."""
    import psutil

    (core,) = [
        p.pid
        for p in psutil.Process(actor_pid).children()
        if "fleetserve.engine.core_proc" in " ".join(p.cmdline())
    ]
    return core


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
