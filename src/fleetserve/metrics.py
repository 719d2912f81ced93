"""Prometheus metrics in the `fleetserve:` namespace, on a registry of their own.

Gauges mirror the engine core's stats (sent with every step); histograms and counters are
fed by the frontend as requests finish. One `ServerMetrics` per server process, so tests
can run several servers (or none) without clashing on the global registry.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetserve.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# Engine stat key -> gauge name (without the namespace) and help text.
_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (0 to 1).",
    "prefix_cache_hit_rate": "Fraction of queried prompt tokens found in the prefix cache.",
    "spec_decode_acceptance_rate": "Fraction of draft tokens the target model accepted.",
    "spec_decode_mean_accepted_length": "Tokens emitted per draft verification (accepted + 1).",
}
# Engine stat key (a running total) -> counter help text.
_COUNTERS = {
    "spec_decode_num_drafts": "Draft verifications (request-steps with draft tokens).",
    "spec_decode_num_draft_tokens": "Draft tokens verified by the target model.",
    "spec_decode_num_accepted_tokens": "Draft tokens the target model accepted.",
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self._gauges = {
            key: Gauge(f"fleetserve:{key}", doc, labels, registry=self.registry).labels(model_name)
            for key, doc in _GAUGES.items()
        }
        self._totals = {
            key: Counter(f"fleetserve:{key}", doc, labels, registry=self.registry).labels(
                model_name
            )
            for key, doc in _COUNTERS.items()
        }
        self._last_totals: dict[str, float] = {}
        self._ttft = Histogram(
            "fleetserve:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._tpot = Histogram(
            "fleetserve:time_per_output_token_seconds",
            "Mean time between output tokens, per finished request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._e2e = Histogram(
            "fleetserve:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._prompt_tokens = Counter(
            "fleetserve:prompt_tokens", "Prompt tokens received.", labels, registry=self.registry
        ).labels(model_name)
        self._generation_tokens = Counter(
            "fleetserve:generation_tokens",
            "Tokens generated.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self._finished = Counter(
            "fleetserve:request_success",
            "Finished completions (one per choice) by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._finished.labels(model_name, reason)

    def set_engine_stats(self, stats: Mapping[str, float]) -> None:
        for key, gauge in self._gauges.items():
            if key in stats:
                gauge.set(stats[key])
        for key, counter in self._totals.items():
            if key in stats:
                # The engine reports running totals; a restarted engine starts again at 0.
                delta = stats[key] - self._last_totals.get(key, 0.0)
                if delta > 0:
                    counter.inc(delta)
                self._last_totals[key] = stats[key]

    def add_prompt_tokens(self, num_tokens: int) -> None:
        self._prompt_tokens.inc(num_tokens)

    def add_generation_tokens(self, num_tokens: int) -> None:
        if num_tokens:
            self._generation_tokens.inc(num_tokens)

    def add_finished(self, finish_reason: str, count: int = 1) -> None:
        self._finished.labels(self.model_name, finish_reason).inc(count)

    def observe_finished(self, out: RequestOutput) -> None:
        """Latencies and finish reasons of a request that finished normally."""
        ttft = out.metrics.get("time_to_first_token")
        e2e = out.metrics.get("e2e_latency")
        if ttft is not None:
            self._ttft.observe(ttft)
        if e2e is not None:
            self._e2e.observe(e2e)
            num_tokens = max(len(c.token_ids) for c in out.outputs)
            if ttft is not None and num_tokens > 1:
                self._tpot.observe((e2e - ttft) / (num_tokens - 1))
        for c in out.outputs:
            self.add_finished(c.finish_reason or "abort")

    def render(self) -> bytes:
        return generate_latest(self.registry)
