"""Start a real `fleetserve serve` process on 127.0.0.1 and wait for it (test helper)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

STARTUP_TIMEOUT_S = 240.0  # several servers may load at once on a 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(
        self, model: str | None, *extra_args: str, env: dict[str, str] | None = None
    ) -> None:
        """`model=None`: no --model (e.g. a fleet given with --config in `extra_args`)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- lives as long as the server
            "w+", prefix="fleetserve-server-", suffix=".log"
        )
        cmd = [
            sys.executable, "-m", "fleetserve.entrypoints.cli", "serve",
            *(["--model", model] if model is not None else []),
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *extra_args,
        ]  # fmt: skip
        # Each server keeps its Batch API state to itself (and leaves none behind).
        self.state_dir = tempfile.TemporaryDirectory(prefix="fleetserve-state-")
        full_env = {**os.environ, "FLEETSERVE_STATE_DIR": self.state_dir.name, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self.core_pid: int | None = None

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    children = psutil.Process(self.proc.pid).children(recursive=True)
                    self.core_pid = children[0].pid if children else None
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        out = self.output()  # before stop(), which closes the log
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{out}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL (of the server and anything it left) if it does not exit."""
        kids = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        for k in kids:
            if k.is_running():
                k.kill()
        if not self.log.closed:
            self.final_output = self.output()
            self.log.close()
        return code


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def pid_alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {'name{label="v",...}': value}, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
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
