"""A server process a benchmark (or a test: tests/server/server_proc.py) starts for itself
on 127.0.0.1: started, waited for, and stopped with everything it started (engine
processes, Ray workers).

The benchmark may signal only processes it started; `owns(pid)` says whether a pid is
one of this server's descendants, so a chaos run never touches anything else.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

# Ports handed out below both the kernel's ephemeral range (32768-60999 by default: where
# port 0 binds land, and every outgoing connection's local port) and Ray's worker ports
# (10002-19999): a port the kernel picked for us was free when we asked, but a Ray
# process or a client socket could take it before the server bound it (the slow stage
# once failed with Ray Serve's proxy "Failed to bind to address '127.0.0.1:36575'").
_PORTS = range(20000, 32000)


def free_port() -> int:
    """A 127.0.0.1 TCP port free now, outside the ranges other processes draw from."""
    rng = random.Random()  # its own seed: parallel test workers draw apart
    for _ in range(64):
        port = rng.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is crowded: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fleetserve_serve_cmd(port: int, *flags: str) -> list[str]:
    """`fleetserve serve` on 127.0.0.1:`port` with this interpreter, no access log (the
    benchmarks measure from outside), then `flags`."""
    return [sys.executable, "-m", "fleetserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--access-log", "off", *flags]  # fmt: skip


def serve_fleet_file(fleet_yaml: str, name: str, *flags: str) -> LocalServer:
    """`fleetserve serve --config` over `fleet_yaml` (written to a fresh temp folder) on a
    free 127.0.0.1 port, warnings only in its log, once ready (600 s at most): the fleet
    benches' server. `name` labels its output and folder."""
    folder = Path(tempfile.mkdtemp(prefix=f"fleetserve-{name}-"))
    (folder / "fleet.yaml").write_text(fleet_yaml)
    port = free_port()
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "serve", "--config",
           str(folder / "fleet.yaml"), "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *flags]  # fmt: skip
    return LocalServer(cmd, port, name=name).wait_ready(600.0)


def vllm_serve_cmd(
    python: str, folder: str, served_name: str, dtype: str, port: int, *flags: str
) -> list[str]:
    """vLLM's OpenAI server (its CPU build in the venv of `python`) for the HF `folder` on
    127.0.0.1:`port`, 2,048 tokens of context, then `flags`."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--served-model-name", served_name, "--dtype", dtype, "--max-model-len", "2048",
            "--host", "127.0.0.1", "--port", str(port), *flags]  # fmt: skip


def vllm_cpu_env(num_threads: int | None, cache_root: str, kvcache_gib: int = 2) -> dict[str, str]:
    """The environment of a vLLM CPU server: its KV cache size, its OpenMP threads pinned
    to cores 0..N-1 (N: `num_threads` or every core), offline, no usage stats, its caches
    in `cache_root`, and none of fleetserve's PYTHONPATH."""
    threads = num_threads or os.cpu_count() or 1
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": cache_root,
        "PYTHONPATH": "",  # fleetserve's sources are not for vLLM's interpreter
    }


def pid_alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LocalServer:
    """`cmd` (a server that binds 127.0.0.1:`port` and answers GET `ready_path` with 200
    once it serves) run as a child process; its output goes to a log file. `new_session`:
    in a session of its own, so that a Ctrl-C of the benchmark reaches the benchmark only."""

    def __init__(
        self,
        cmd: Sequence[str],
        port: int,
        env: dict[str, str] | None = None,
        name: str = "",
        *,
        new_session: bool = True,
        ready_path: str = "/ready",
    ) -> None:
        self.port = port
        self.ready_path = ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.name = name or os.path.basename(cmd[0])
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- lives as long as the server
            "w+", prefix=f"fleetserve-bench-{self.name}-", suffix=".log"
        )
        self.proc = subprocess.Popen(
            list(cmd),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout_s: float) -> LocalServer:
        deadline = time.monotonic() + timeout_s
        # One client for the polls: each new one builds an SSL context (~25 ms of CPU).
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-4000:]}"
                    )
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        out = self.output()
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:g} s:\n{out[-4000:]}")

    def descendants(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return kids

    def owns(self, pid: int) -> bool:
        """Whether `pid` is a live descendant of this server (one it started)."""
        return any(k.pid == pid for k in self.descendants())

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit; then SIGKILL any of its descendants
        still running (each by pid, only those seen as its descendants)."""
        kids = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        for k in kids:
            try:
                if k.is_running() and k.status() != psutil.STATUS_ZOMBIE:
                    k.kill()
            except psutil.NoSuchProcess:
                pass
        if not self.log.closed:
            self.final_output = self.output()
            self.log.close()
        return code
