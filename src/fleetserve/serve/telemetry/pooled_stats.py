"""A generate model's engine gauges, pooled over its live replicas' latest stats: each
replica reports its own engine's figures (Replica.stats); the model-level series sum the
counts, average the KV use and pool the ratios from their totals."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fleetserve.metrics import ModelMetrics
from fleetserve.serve.contracts import Replica


def publish_pooled_stats(metrics: ModelMetrics | None, live: Iterable[Replica]) -> None:
    """Sets the model-level gauges from the replicas that have reported (none: unchanged)."""
    stats = [r.stats.as_metrics() for r in live if r.stats is not None]
    if metrics is not None and stats:
        metrics.set_engine_stats(pooled_stats(stats), replica=None)


def pooled_stats(stats: Sequence[Mapping[str, float]]) -> dict[str, float]:
    queries = sum(s.get("prefix_cache_queries", 0.0) for s in stats)
    hits = sum(s.get("prefix_cache_hits", 0.0) for s in stats)
    usage = sum(s.get("kv_cache_usage_perc", 0.0) for s in stats)
    return {
        "num_requests_running": sum(s.get("num_requests_running", 0.0) for s in stats),
        "kv_cache_usage_perc": usage / len(stats) if stats else 0.0,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        **spec_decode_totals(stats),
    }


def spec_decode_totals(stats: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Speculative decoding totals and ratios over the replicas (none when it is off)."""
    if not any("spec_decode_num_drafts" in s for s in stats):
        return {}
    keys = (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    )
    n, drafts, accepted = (sum(s.get(k, 0.0) for s in stats) for k in keys)
    return {
        **dict(zip(keys, (n, drafts, accepted), strict=True)),
        "spec_decode_acceptance_rate": accepted / drafts if drafts else 0.0,
        "spec_decode_mean_accepted_length": 1 + accepted / n if n else 0.0,
    }
