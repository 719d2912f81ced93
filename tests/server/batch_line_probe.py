"""A Batch API file with one huge line among good and bad ones, against a running server
(docs/benchmarks.md, Hardening II): /health latency and the API process's RSS meanwhile.

    python tests/server/batch_line_probe.py http://127.0.0.1:PORT API_PID MB [MODEL]
"""

from __future__ import annotations

import json
import os
import sys
import time

import openai

sys.path.insert(0, os.path.dirname(__file__))
from large_inputs import HealthProbe, rss_mb  # noqa: E402


def line(custom_id: str, model: str, **body: object) -> str:
    body = {"model": model, "max_tokens": 4, **body}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    )


def main() -> None:
    url, pid, mb = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    model = sys.argv[4] if len(sys.argv) > 4 else "chat"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    lines = [
        line("ok-1", model, prompt="The capital of France is"),
        line("huge", model, prompt="hello world " * int(mb * 2**20 / 12)),
        line("long", model, prompt="hello world " * int(7 * 2**20 / 12)),
        line("tier", model, prompt="hi", service_tier="nope"),
        line("ok-2", model, prompt="One, two,"),
    ]
    data = ("\n".join(lines) + "\n").encode()
    before = rss_mb(pid)
    with HealthProbe(url) as health:
        started = time.time()
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        while b.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.2)
            b = client.batches.retrieve(b.id)
        took = time.time() - started
    print(f"file {len(data) / 2**20:.1f} MiB: {b.status} {b.request_counts} in {took:.1f} s")
    if b.error_file_id:
        for text in client.files.content(b.error_file_id).text.splitlines():
            e = json.loads(text)
            status = (e["response"] or {}).get("status_code")
            print(e["custom_id"], status, e["error"]["message"][:150])
    print(
        f"health p50 {health.quantile(0.5) * 1000:.1f} ms, max "
        f"{max(health.latencies_s) * 1000:.1f} ms ({len(health.latencies_s)} probes)"
    )
    print(f"rss before {before:.0f} MB, after {rss_mb(pid):.0f} MB")


if __name__ == "__main__":
    main()
