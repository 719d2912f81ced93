"""Start a real `fleetserve serve` process on 127.0.0.1 and wait for it (test helper): the
benchmarks' LocalServer (fleetserve/bench/local_server.py) with the serve command line, a
Batch API state dir of its own, and the pid of its first engine process once ready."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fleetserve.bench.local_server import LocalServer, free_port, pid_alive

__all__ = ["ServerProc", "free_port", "metric", "pid_alive", "scrape", "wait_until"]

STARTUP_TIMEOUT_S = 240.0  # several servers may load at once on a 2-core machine


class ServerProc(LocalServer):
    def __init__(
        self, model: str | None, *extra_args: str, env: dict[str, str] | None = None
    ) -> None:
        """`model=None`: no --model (e.g. a fleet given with --config in `extra_args`)."""
        port = free_port()
        cmd = [
            sys.executable, "-m", "fleetserve.entrypoints.cli", "serve",
            *(["--model", model] if model is not None else []),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra_args,
        ]  # fmt: skip
        # Each server keeps its Batch API state to itself (and leaves none behind).
        self.state_dir = tempfile.TemporaryDirectory(prefix="fleetserve-state-")
        env = {"FLEETSERVE_STATE_DIR": self.state_dir.name, **(env or {})}
        # In the tests' session: an interrupted run takes its servers down with it.
        super().__init__(cmd, port, env, name="server", new_session=False)
        self.core_pid: int | None = None

    @classmethod
    def fleet(cls, config_text: str, folder: Path, env: dict[str, str] | None = None) -> ServerProc:
        """A (not yet ready) server of the fleet file `config_text`, written into `folder`,
        with tests/ on its PYTHONPATH (the handlers and rules the tests' fleets name)."""
        path = folder / "fleet.yaml"
        path.write_text(config_text)
        tests_dir = str(Path(__file__).resolve().parent.parent)
        pythonpath = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
        return cls(None, "--config", str(path), env={**(env or {}), "PYTHONPATH": pythonpath})

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProc:
        super().wait_ready(timeout_s)
        children = self.descendants()
        self.core_pid = children[0].pid if children else None
        return self


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


@functools.cache
def _client() -> httpx.Client:
    """One client for the polls (scrape): a new one per request builds an SSL context,
    ~25 ms of CPU."""
    return httpx.Client()


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {'name{label="v",...}': value}, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = _client().get(f"{url}/metrics", headers=headers, timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}"] = s.value
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in values.items():
        key_name, _, rest = key.partition("{")
        if key_name == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


def start_prometheus(config_yaml: str, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A real Prometheus on a free 127.0.0.1 port with `config_yaml` (its storage under
    `folder`), once it is ready: the process and its HTTP API's base URL (.../api/v1).
    Until its storage is open Prometheus answers 503 "Service Unavailable" (plain text, not
    the API's JSON) to every query, so this waits for /-/ready."""
    path = folder / "prometheus.yml"
    path.write_text(config_yaml)
    port = free_port()
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={path}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_until(ready, timeout_s=60, interval_s=0.2):
        stop_process(proc)
        raise AssertionError("Prometheus did not become ready in 60 s")
    return proc, f"{base}/api/v1"


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL past 15 s."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
