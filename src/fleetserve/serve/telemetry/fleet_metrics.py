"""Series read from the services at scrape time: the per-replica ones (label `replica`)
of every generate model, and the queue depth `fleetserve:num_requests_waiting{model_name,
class}` (requests not yet started: queued in the class queue, or sent and not begun), the
one signal autoscalers read."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fleetserve.engine.stats import EngineStats
from fleetserve.serve.services.generate import GenerateService

_LABELS = ["model_name", "replica"]


class FleetCollector(Collector):
    def __init__(self, services: Sequence[Any]) -> None:
        self.services = services

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        waiting = GaugeMetricFamily(
            "fleetserve:num_requests_waiting",
            "Requests not started yet: in their class queue, or sent and not yet begun.",
            labels=["model_name", "class"],
        )
        for service in self.services:
            for name, n in service.waiting_by_class().items():
                waiting.add_metric([service.name, name], n)
        yield waiting
        generate = [s for s in self.services if isinstance(s, GenerateService)]
        yield self._pools(generate)
        yield from self._replicas(generate)

    def _pools(self, services: list[GenerateService]) -> GaugeMetricFamily:
        """Replicas per pool, capacity and state (every state of every pool, 0 included)."""
        family = GaugeMetricFamily(
            "fleetserve:replicas",
            "Replicas of a generate model by pool, capacity (spot / on_demand) and state.",
            labels=["model_name", "pool", "capacity", "state"],
        )
        for service in services:
            counts = Counter(
                (v["pool"], v["capacity"], v["state"]) for v in service.replica_views()
            )
            for pool in service.pools:
                for state in ("starting", "ready", "draining", "dead"):
                    n = counts[(pool.name, pool.capacity, state)]
                    family.add_metric([service.name, pool.name, pool.capacity, state], n)
        return family

    def _replicas(
        self, services: list[GenerateService]
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"fleetserve:replica_{name}", doc, labels=_LABELS)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"fleetserve:replica_{name}", doc, labels=_LABELS)

        latency = gauge("step_latency_seconds", "EWMA of the replica's engine step time.")
        tokens = gauge(
            "outstanding_tokens",
            "Prompt tokens not yet prefilled plus tokens still to generate, routed to it.",
        )
        requests = gauge("outstanding_requests", "Requests routed to it and not finished.")
        waiting = gauge("num_requests_waiting", "Requests waiting in its scheduler.")
        running = gauge("num_requests_running", "Requests its engine runs.")
        hit_rate = gauge(
            "prefix_cache_hit_rate", "Fraction of its queried prompt tokens found cached."
        )
        healthy = gauge("healthy", "1 while its engine process is up and serving.")
        straggler = gauge("straggler", "1 while routed around as much slower than its peers.")
        routed = counter("requests_routed", "Requests the router sent to it.")
        queried = counter("prefix_cache_queries", "Prompt tokens looked up in its prefix cache.")
        hits = counter("prefix_cache_hits", "Prompt tokens found in its prefix cache.")
        for service in services:
            slow = {r.index for r in service.router.stragglers()}
            for r in service.replica_set:
                stats = r.stats or EngineStats()
                labels = [service.name, str(r.index)]
                latency.add_metric(labels, r.step_latency_s or 0.0)
                tokens.add_metric(labels, r.num_outstanding_tokens)
                requests.add_metric(labels, r.num_outstanding_requests)
                waiting.add_metric(labels, r.queue_depth)
                running.add_metric(labels, stats.num_requests_running)
                hit_rate.add_metric(labels, r.prefix_cache_hit_rate)
                healthy.add_metric(labels, 1.0 if r.healthy else 0.0)
                straggler.add_metric(labels, 1.0 if r.index in slow else 0.0)
                routed.add_metric(labels, r.num_routed)
                queried.add_metric(labels, stats.prefix_cache_queries)
                hits.add_metric(labels, stats.prefix_cache_hits)
        yield from (latency, tokens, requests, waiting, running, hit_rate, healthy, straggler)
        yield from (routed, queried, hits)
