"""SIGKILL one replica's engine process of a running server (2+ replicas) and time until
/admin/replicas no longer lists it ready (docs/benchmarks.md, Hardening II).

    python tests/server/replica_kill_probe.py http://127.0.0.1:PORT [TRIALS]
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import httpx


def replicas(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/admin/replicas", timeout=5).json()["data"]  # type: ignore[no-any-return]


def one_trial(url: str) -> tuple[float, str]:
    ready: list[dict[str, Any]] = []
    while len(ready) < 2:
        ready = [r for r in replicas(url) if r["state"] == "ready"]
        time.sleep(0.2)
    pid, rid = ready[0]["pid"], ready[0]["id"]
    started = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while True:
        now = [r for r in replicas(url) if r["id"] == rid]
        if not now or now[0]["state"] != "ready" or now[0]["pid"] != pid:
            return time.perf_counter() - started, now[0]["state"] if now else "removed"
        time.sleep(0.005)


def main() -> None:
    url = sys.argv[1]
    for trial in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        took, state = one_trial(url)
        print(f"trial {trial}: noticed after {took * 1000:.1f} ms ({state})", flush=True)
        time.sleep(1.0)


if __name__ == "__main__":
    main()
