"""/metrics in Prometheus format: parsed by prometheus_client, and scraped by Prometheus."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from server_proc import ServerProc, metric, scrape, start_prometheus, stop_process, wait_until

NAMES = (
    "fleetserve:num_requests_running",
    "fleetserve:num_requests_waiting",
    "fleetserve:kv_cache_usage_perc",
    "fleetserve:prefix_cache_hit_rate",
    "fleetserve:time_to_first_token_seconds_count",
    "fleetserve:time_per_output_token_seconds_count",
    "fleetserve:e2e_request_latency_seconds_count",
    "fleetserve:prompt_tokens_total",
    "fleetserve:generation_tokens_total",
    "fleetserve:request_success_total",
)


def run_requests(url: str, num: int, max_tokens: int) -> int:
    """`num` greedy requests of exactly max_tokens; returns the prompt tokens they used."""
    prompt_tokens = 0
    for i in range(num):
        body = {"prompt": f"Our teacher counted {i}", "max_tokens": max_tokens, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200
        prompt_tokens += resp.json()["usage"]["prompt_tokens"]
    return prompt_tokens


def test_metrics_counts(server: ServerProc) -> None:
    url = server.url
    run_requests(url, 1, max_tokens=2)  # every series exists after one request
    assert wait_until(lambda: metric(scrape(url), "fleetserve:num_requests_running") == 0, 10)
    before = scrape(url)
    for name in NAMES:
        assert any(k.startswith(name + "{") for k in before), name
    prompt_tokens = run_requests(url, 3, max_tokens=5)
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("fleetserve:prompt_tokens_total") == prompt_tokens
    assert delta("fleetserve:generation_tokens_total") == 15
    assert delta("fleetserve:request_success_total", finished_reason="length") == 3
    assert delta("fleetserve:request_success_total", finished_reason="stop") == 0
    assert delta("fleetserve:time_to_first_token_seconds_count") == 3
    assert delta("fleetserve:time_per_output_token_seconds_count") == 3
    assert delta("fleetserve:e2e_request_latency_seconds_count") == 3
    assert delta("fleetserve:e2e_request_latency_seconds_sum") > 0
    # The engine's steps ran each prompt and 4 of its 5 tokens (the last is not fed back).
    assert delta("fleetserve:num_step_tokens_total") == prompt_tokens + 3 * 4
    assert delta("fleetserve:num_steps_total") >= 3 * 5
    assert delta("fleetserve:step_seconds_total") > 0
    assert 0 <= metric(after, "fleetserve:prefix_cache_hit_rate") <= 1
    assert metric(after, "fleetserve:num_requests_running") == 0


PROM_CONFIG = """
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: fleetserve
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary")
def test_prometheus_scrapes_server(server: ServerProc, tmp_path: Path) -> None:
    prom, api = start_prometheus(PROM_CONFIG.format(port=server.port), tmp_path)

    def query(promql: str) -> float | None:
        try:
            resp = httpx.get(f"{api}/query", params={"query": promql}, timeout=5)
        except httpx.HTTPError:
            return None
        result = resp.json()["data"]["result"] if resp.status_code == 200 else []
        return float(result[0]["value"][1]) if result else None

    try:
        up = 'up{job="fleetserve"}'
        assert wait_until(lambda: query(up) == 1.0, timeout_s=60, interval_s=0.5)
        run_requests(server.url, 2, max_tokens=4)
        expected = scrape(server.url)
        want_length = metric(expected, "fleetserve:request_success_total", finished_reason="length")
        want_tokens = metric(expected, "fleetserve:generation_tokens_total")
        length_q = 'sum(fleetserve:request_success_total{finished_reason="length"})'
        tokens_q = "sum(fleetserve:generation_tokens_total)"
        ok = wait_until(
            lambda: query(length_q) == want_length and query(tokens_q) == want_tokens,
            timeout_s=30,
            interval_s=0.5,
        )
        assert ok, (query(length_q), want_length, query(tokens_q), want_tokens)
        assert query('fleetserve:num_requests_running{job="fleetserve"}') == 0.0
        hist = "sum(fleetserve:e2e_request_latency_seconds_count)"
        assert (query(hist) or 0) >= 2
    finally:
        stop_process(prom)
