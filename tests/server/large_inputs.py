"""Large inputs against a running server, measured (the tests' probe, and a script):
/health's latency while huge prompts are refused, and the server's resident memory
before and after.

    python tests/server/large_inputs.py --url http://127.0.0.1:PORT --pid PID [--mb 7] [--n 10]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil


@dataclass
class HealthProbe:
    """Polls GET /health every `interval_s` on a thread of its own; `latencies_s` are the
    round trips (a probe that fails counts as its time to fail)."""

    url: str
    interval_s: float = 0.02
    latencies_s: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    self.statuses.append(client.get(f"{self.url}/health").status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                self.latencies_s.append(time.perf_counter() - t)
                self._stop.wait(self.interval_s)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


def huge_bodies(model: str, num_bytes: int) -> tuple[bytes, bytes]:
    """A completions and a chat body of about `num_bytes`, encoded once (so that the
    probe's own JSON encoding does not hold the GIL the health poller needs)."""
    text = "hello world " * (num_bytes // 12)
    completion = {"model": model, "prompt": text, "max_tokens": 1}
    chat = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return json.dumps(completion).encode(), json.dumps(chat).encode()


def post_json(url: str, path: str, body: bytes) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=120)


def probe(url: str, pid: int, model: str, mb: float, n: int) -> dict[str, object]:
    """`n` huge requests (completions and chat in turn), two at a time, with /health
    polled meanwhile; RSS before, after, and after a settle second."""
    completion, chat = huge_bodies(model, int(mb * 2**20))
    before = rss_mb(pid)
    statuses: list[int] = []
    with HealthProbe(url) as health:
        for start in range(0, n, 2):
            threads = []
            for i in range(start, min(n, start + 2)):
                path, body = ("/v1/completions", completion) if i % 2 == 0 else (
                    "/v1/chat/completions", chat)  # fmt: skip

                def one(path: str = path, body: bytes = body) -> None:
                    statuses.append(post_json(url, path, body).status_code)

                threads.append(threading.Thread(target=one))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    after = rss_mb(pid)
    time.sleep(1.0)
    return {
        "statuses": sorted(set(statuses)),
        "health_probes": len(health.latencies_s),
        "health_statuses": sorted(set(health.statuses)),
        "health_p50_ms": round(health.quantile(0.5) * 1000, 1),
        "health_p99_ms": round(health.quantile(0.99) * 1000, 1),
        "health_max_ms": round(max(health.latencies_s) * 1000, 1),
        "rss_before_mb": round(before, 1),
        "rss_after_mb": round(after, 1),
        "rss_settled_mb": round(rss_mb(pid), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--pid", type=int, required=True, help="the API process")
    p.add_argument("--model", default="default")
    p.add_argument("--mb", type=float, default=7.0)
    p.add_argument("--n", type=int, default=10)
    args = p.parse_args()
    print(json.dumps(probe(args.url, args.pid, args.model, args.mb, args.n), indent=1))


if __name__ == "__main__":
    main()
