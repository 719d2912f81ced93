"""Prometheus metrics in the `fleetserve:` namespace, on a registry of their own.

Gauges mirror the engine cores' stats (sent with every step); histograms and counters are
fed by the frontend as requests finish. One `ServerMetrics` per server process, so tests
can run several servers (or none) without clashing on the global registry; each model of
the fleet has its `ModelMetrics` view of it (label `model_name`, vLLM's name).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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

# Engine stat key -> gauge name (without the namespace) and help text. The waiting count
# is not among them: it is the model service's, per class (see ModelMetrics.collect_waiting).
_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (0 to 1).",
    "prefix_cache_hit_rate": "Fraction of queried prompt tokens found in the prefix cache.",
    "spec_decode_acceptance_rate": "Fraction of draft tokens the target model accepted.",
    "spec_decode_mean_accepted_length": "Tokens emitted per draft verification (accepted + 1).",
}
# Engine stat key (a running total) -> counter help text.
_COUNTERS = {
    "num_preemptions": "Requests the engine preempted (KV blocks or seats ran short).",
    "num_steps": "Engine steps that ran (forward passes).",
    "step_seconds": "Wall seconds the engine spent in steps (its busy time).",
    "num_step_tokens": "Tokens the engine's steps ran (prompt chunks, decodes, drafts).",
    "spec_decode_num_drafts": "Draft verifications (request-steps with draft tokens).",
    "spec_decode_num_draft_tokens": "Draft tokens verified by the target model.",
    "spec_decode_num_accepted_tokens": "Draft tokens the target model accepted.",
}


# The label values known before any request, exported at 0 from the start (declare()).
SHED_REASONS = ("queue_full", "queue_timeout", "no_replica")
REPLICA_EVENTS = ("started", "start_failed", "no_capacity", "failed", "hung", "notice", "drained")
ROUTES_BY_KIND = {
    "generate": ("/v1/completions", "/v1/chat/completions"),
    "embed": ("/v1/embeddings",),
    "custom": ("/v1/models/{name}:predict",),
}


class ServerMetrics:
    """The server's registry and metric families; `model(name)` gives one model's view.
    Every series carries `model_name`; the per-request ones carry `class` as well."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m, mc = ["model_name"], ["model_name", "class"]
        self.gauges = {
            key: Gauge(f"fleetserve:{key}", doc, m, registry=r) for key, doc in _GAUGES.items()
        }
        self.totals = {
            key: Counter(f"fleetserve:{key}", doc, m, registry=r) for key, doc in _COUNTERS.items()
        }
        self.ttft = Histogram(
            "fleetserve:time_to_first_token_seconds",
            "Time from arrival (class queue included) to the first generated token.",
            mc, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "fleetserve:time_per_output_token_seconds",
            "Mean time between output tokens, per finished request.",
            mc, buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "fleetserve:e2e_request_latency_seconds",
            "Time from arrival (class queue included) to the last token.",
            mc, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "fleetserve:prompt_tokens", "Prompt tokens received.", m, registry=r
        )
        self.generation_tokens = Counter(
            "fleetserve:generation_tokens", "Tokens generated.", m, registry=r
        )
        self.finished = Counter(
            "fleetserve:request_success",
            "Finished completions (one per choice) by finish reason.",
            ["model_name", "finished_reason"], registry=r,
        )  # fmt: skip
        self.shed = Counter(
            "fleetserve:requests_shed",
            "Requests refused before any compute: its class queue full, or its queue time over.",
            ["model_name", "class", "reason"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "fleetserve:request_migrations",
            "Requests resumed on another replica after theirs was lost, by why it was lost.",
            ["model_name", "reason"], registry=r,
        )  # fmt: skip
        self.hedges = Counter(
            "fleetserve:request_hedges",
            "Hedged requests (no first output by their class's hedge_after_s, so a copy was "
            "sent to another replica), by which call answered first: first or copy.",
            ["model_name", "winner"], registry=r,
        )  # fmt: skip
        self.replica_events = Counter(
            "fleetserve:replica_events",
            "Replica lifecycle events: started, start_failed, no_capacity (its pool had "
            "none), failed (died), hung, notice, drained.",
            ["model_name", "event"], registry=r,
        )  # fmt: skip
        self.http_requests = Counter(
            "fleetserve:http_requests",
            "HTTP requests for a model, by class, route (the path's template, e.g. "
            "/v1/chat/completions) and the status their outcome stands for (a stream that "
            "failed after its 200 counts as its error's status; 499: the client left).",
            ["model_name", "class", "route", "status"], registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "fleetserve:batch_size",
            "Requests per batch run by an embed or custom model's dynamic batcher.",
            m, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r,
        )  # fmt: skip
        self.batch_seconds = Histogram(
            "fleetserve:batch_duration_seconds",
            "Time to run one batch of an embed or custom model.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.models: dict[str, ModelMetrics] = {}

    def count_response(self, model_name: str, class_name: str, route: str, status: int) -> None:
        """One HTTP request for a known model on one of the server's routes (names clients
        send that match no model, and raw paths, are never labels: they would make series
        without bound)."""
        self.http_requests.labels(model_name, class_name, route, str(status)).inc()

    def model(self, model_name: str) -> ModelMetrics:
        if model_name not in self.models:
            self.models[model_name] = ModelMetrics(self, model_name)
        return self.models[model_name]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's series. AsyncEngine feeds the token counts, finish reasons and engine
    gauges; the model service feeds the latencies by class and the shed counts."""

    def __init__(self, server: ServerMetrics, model_name: str) -> None:
        self.server = server
        self.model_name = model_name
        self.registry = server.registry
        self._gauges = {key: g.labels(model_name) for key, g in server.gauges.items()}
        self._totals = {key: c.labels(model_name) for key, c in server.totals.items()}
        self._last_totals: dict[tuple[int, str], float] = {}
        self._prompt_tokens = server.prompt_tokens.labels(model_name)
        self._generation_tokens = server.generation_tokens.labels(model_name)
        for reason in ("stop", "length", "abort"):
            server.finished.labels(model_name, reason)
        # Exported at 0 from the start, so that rates read 0 rather than nothing.
        for reason in ("died", "drained", "stopped", "hung"):
            server.migrations.labels(model_name, reason)
        for winner in ("first", "copy"):
            server.hedges.labels(model_name, winner)

    def declare(self, kind: str, class_names: Iterable[str], batches: bool = True) -> None:
        """Export at 0 every series whose labels are known before the first request: per
        class the latencies and sheds of a generate model, its replica events, a batch
        model's batch sizes (`batches`: its batcher feeds this registry), and each of the
        model's routes answered 200, so that dashboards and alerts read 0, not "no data"."""
        s, name = self.server, self.model_name
        classes = list(class_names) if kind == "generate" else [""]
        for cls in classes:
            for route in ROUTES_BY_KIND.get(kind, ()):
                s.http_requests.labels(name, cls, route, "200")
        if kind == "generate":
            for cls in classes:
                for histogram in (s.ttft, s.tpot, s.e2e):
                    histogram.labels(name, cls)
                for reason in SHED_REASONS:
                    s.shed.labels(name, cls, reason)
            for event in REPLICA_EVENTS:
                s.replica_events.labels(name, event)
        elif batches:
            s.batch_size.labels(name)
            s.batch_seconds.labels(name)

    def set_engine_stats(self, stats: Mapping[str, float], replica: int | None = 0) -> None:
        """One engine's stats (`replica`: its index), or with replica=None the model's
        gauges pooled over its replicas (running totals are then left alone)."""
        for key, gauge in self._gauges.items():
            if key in stats:
                gauge.set(stats[key])
        if replica is None:
            return
        for key, counter in self._totals.items():
            if key in stats:
                # Each engine reports its running totals; a new engine starts again at 0.
                delta = stats[key] - self._last_totals.get((replica, key), 0.0)
                if delta > 0:
                    counter.inc(delta)
                self._last_totals[(replica, key)] = stats[key]

    def clear_engine_stats(self) -> None:
        for gauge in self._gauges.values():
            gauge.set(0.0)

    def add_prompt_tokens(self, num_tokens: int) -> None:
        self._prompt_tokens.inc(num_tokens)

    def add_generation_tokens(self, num_tokens: int) -> None:
        if num_tokens:
            self._generation_tokens.inc(num_tokens)

    def add_finished(self, finish_reason: str, count: int = 1) -> None:
        self.server.finished.labels(self.model_name, finish_reason).inc(count)

    def observe_finished(self, out: RequestOutput) -> None:
        """Finish reasons of the choices a delta ends (each choice ends in one delta;
        latencies: observe_latency)."""
        for c in out.outputs:
            if c.finish_reason is not None:
                self.add_finished(c.finish_reason)

    def observe_latency(
        self, class_name: str, ttft: float | None, e2e: float | None, num_tokens: int
    ) -> None:
        """One finished request's latencies, measured from its arrival at the service."""
        s = self.server
        if ttft is not None:
            s.ttft.labels(self.model_name, class_name).observe(ttft)
        if e2e is not None:
            s.e2e.labels(self.model_name, class_name).observe(e2e)
            if ttft is not None and num_tokens > 1:
                s.tpot.labels(self.model_name, class_name).observe((e2e - ttft) / (num_tokens - 1))

    def add_migration(self, reason: str) -> None:
        self.server.migrations.labels(self.model_name, reason).inc()

    def add_hedge(self, winner: str) -> None:
        self.server.hedges.labels(self.model_name, winner).inc()

    def add_replica_event(self, event: str) -> None:
        self.server.replica_events.labels(self.model_name, event).inc()

    def add_shed(self, class_name: str, reason: str) -> None:
        self.server.shed.labels(self.model_name, class_name, reason).inc()

    def observe_batch(self, size: int, seconds: float) -> None:
        """A dynamic batcher's `on_batch(size, seconds)` callback."""
        self.server.batch_size.labels(self.model_name).observe(size)
        self.server.batch_seconds.labels(self.model_name).observe(seconds)
