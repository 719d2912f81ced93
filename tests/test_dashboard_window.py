"""The dashboard's figures from the metrics registry: windowed counter increases, and
histogram quantiles checked against numpy's exact quantiles of the same observations
(the estimate must fall in the bucket that holds the true quantile, as Prometheus'
histogram_quantile does); then a whole snapshot over a ServerMetrics."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from fleetserve.entrypoints.openai.dashboard.snapshot import Snapshots
from fleetserve.entrypoints.openai.dashboard.window import (
    History,
    Totals,
    Window,
    bucket_quantile,
    read_totals,
)
from fleetserve.metrics import ServerMetrics

BOUNDS = (0.001, 0.01, 0.02, 0.04, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def test_bucket_quantile_interpolates_inside_the_bucket() -> None:
    # 2 observations <= 1, 4 more in (1, 2], 2 above 2.
    buckets = {1.0: 2.0, 2.0: 6.0, math.inf: 8.0}
    assert bucket_quantile(0.5, buckets) == pytest.approx(1.5)  # rank 4: half-way in (1, 2]
    assert bucket_quantile(0.25, buckets) == pytest.approx(1.0)  # rank 2: the top of [0, 1]
    assert bucket_quantile(0.125, buckets) == pytest.approx(0.5)
    assert bucket_quantile(0.99, buckets) == 2.0  # in +Inf: the highest finite bound
    assert bucket_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None  # no observations
    assert bucket_quantile(0.5, {}) is None
    with pytest.raises(ValueError, match="q must be in"):
        bucket_quantile(1.5, buckets)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=20.0), min_size=1, max_size=300),
    st.sampled_from([0.5, 0.9, 0.99]),
)
# Found by hypothesis: interpolating up to a bucket's top bound rounded past it.
@example([1.0, 0.0078125], 0.5)
def test_quantile_lands_in_the_bucket_of_the_true_quantile(
    observations: list[float], q: float
) -> None:
    registry = CollectorRegistry()
    hist = Histogram("fleetserve:x_seconds", "x", ["model_name"], buckets=BOUNDS, registry=registry)
    for x in observations:
        hist.labels("m").observe(x)
    empty = Totals(0.0, {})
    estimate = Window(empty, read_totals(registry, 1.0)).quantile(q, "fleetserve:x_seconds")
    # The exact quantile: the smallest observation with at least q of them at or below it.
    true = float(np.quantile(np.array(observations), q, method="inverted_cdf"))
    upper = next((b for b in BOUNDS if true <= b), math.inf)
    lower = max((b for b in BOUNDS if b < upper), default=0.0)
    assert estimate is not None
    if math.isinf(upper):
        assert estimate == BOUNDS[-1]
    else:
        assert lower <= estimate <= upper, (true, estimate, lower, upper)


def test_windows_pick_the_newest_copy_old_enough_and_count_new_series() -> None:
    registry = CollectorRegistry()
    c = Counter("fleetserve:things", "x", ["model_name", "replica"], registry=registry)
    history = History(horizon_s=60.0)
    c.labels("m", "0").inc(10)
    history.add(read_totals(registry, 0.0))
    c.labels("m", "0").inc(5)
    history.add(read_totals(registry, 5.0))
    c.labels("m", "0").inc(1)
    c.labels("m", "1").inc(4)  # a replica that started since: counted from 0
    history.add(read_totals(registry, 5.2))  # closer than min_spacing_s: not kept
    now = read_totals(registry, 12.0)
    history.add(now)
    w = history.window(now, 10.0)
    assert w.seconds == 12.0 and w.increase("fleetserve:things_total", model_name="m") == 10.0
    assert w.rate("fleetserve:things_total", replica="1") == pytest.approx(4 / 12)
    short = history.window(now, 5.0)
    assert short.seconds == 7.0 and short.increase("fleetserve:things_total") == 5.0
    assert history.window(now, 0.0).rate("fleetserve:things_total") is None  # no time yet
    # A series that went down restarted: its new value is its increase.
    lower = Totals(13.0, {"fleetserve:things_total": {(("model_name", "m"),): 3.0}})
    base = Totals(0.0, {"fleetserve:things_total": {(("model_name", "m"),): 9.0}})
    assert Window(base, lower).increase("fleetserve:things_total") == 3.0
    # Copies older than the longest window (beyond the one that reaches it) are dropped.
    history.add(read_totals(registry, 100.0))
    assert history.window(read_totals(registry, 101.0), 60.0).base.t == 12.0
    with pytest.raises(ValueError, match="horizon_s"):
        History(horizon_s=0)


class FakeGenerate:
    """A generate model's service as the snapshot reads it."""

    name, kind, is_ready, dead_reason = "gen", "generate", True, None

    def waiting_by_class(self) -> dict[str, int]:
        return {"interactive": 2, "batch": 0}

    def replica_views(self) -> list[dict[str, Any]]:
        return [{"index": 0, "pool": "spot", "capacity": "spot", "state": "ready", "pid": 7,
                 "num_requests": 1}]  # fmt: skip


class FakeEmbed:
    name, kind, is_ready, dead_reason = "emb", "embed", False, None

    def waiting_by_class(self) -> dict[str, int]:
        return {"": 3}


def test_snapshot_rates_errors_and_percentiles_per_model_and_class() -> None:
    metrics = ServerMetrics()
    clock = [100.0]
    snaps = Snapshots(metrics, [FakeGenerate(), FakeEmbed()], clock=lambda: clock[0])
    first = snaps.take()
    assert [m["name"] for m in first["models"]] == ["gen", "emb"]
    assert first["models"][0]["requests_per_s"] is None  # one copy: no window yet
    gen = metrics.model("gen")
    for ttft in (0.03, 0.03, 0.03, 0.3):
        gen.observe_latency("interactive", ttft, ttft + 0.5, num_tokens=11)
        metrics.count_response("gen", "interactive", "/v1/completions", 200)
    metrics.count_response("gen", "interactive", "/v1/completions", 503)  # an error
    metrics.count_response(
        "gen", "batch", "/v1/chat/completions", 499
    )  # a client that left: not an error
    gen.add_generation_tokens(40)
    gen.add_migration("drained")
    metrics.count_response("emb", "", "/v1/embeddings", 200)
    clock[0] += 5.0
    snap = snaps.take()
    g, e = snap["models"]
    assert snap["rate_window_s"] == 5.0
    assert g["requests_per_s"] == pytest.approx(6 / 5) and g["errors_per_s"] == pytest.approx(0.2)
    assert g["requests_total"] == 6 and g["errors_total"] == 1 and g["waiting"] == 2
    assert g["generation_tokens_per_s"] == pytest.approx(8.0)
    inter, batch = g["classes"]
    assert (inter["name"], inter["waiting"], inter["requests_total"]) == ("interactive", 2, 5)
    assert batch["errors_per_s"] == 0.0 and batch["ttft"]["p50"] is None
    assert 0.02 < inter["ttft"]["p50"] <= 0.04  # three of four in (0.02, 0.04]
    assert 0.25 < inter["ttft"]["p99"] <= 0.5
    assert 0.025 < inter["tpot"]["p50"] <= 0.05  # (e2e - ttft) / 10 tokens: in (0.025, 0.05]
    assert {k: v for k, v in g["migrations"].items() if v} == {"drained": 1.0}
    (replica,) = g["replicas"]
    assert replica["pool"] == "spot" and replica["state"] == "ready" and replica["pid"] == 7
    assert replica["healthy"] is False  # no per-replica series registered here
    assert e["state"] == "loading" and e["classes"][0]["requests_total"] == 1
    assert e["replicas"] == [] and e["waiting"] == 3
    fleet = snap["fleet"]
    assert fleet["num_models"] == 2 and fleet["num_replicas"] == 1 and fleet["waiting"] == 5
    assert fleet["requests_per_s"] == pytest.approx(7 / 5) and fleet["migrations_total"] == 1


class FakeRayGenerate:
    """A generate model on Ray: no admin view of its replicas, only the router's series."""

    name, kind, is_ready, dead_reason = "ray", "generate", True, None

    def waiting_by_class(self) -> dict[str, int]:
        return {"default": 0}


class RouterSeries:
    def collect(self) -> Any:
        g = GaugeMetricFamily(
            "fleetserve:replica_outstanding_requests", "x", labels=["model_name", "replica"]
        )
        g.add_metric(["ray", "10"], 2.0)
        g.add_metric(["ray", "2"], 0.0)
        yield g


def test_replicas_without_an_admin_view_come_from_the_series() -> None:
    metrics = ServerMetrics()
    metrics.registry.register(RouterSeries())  # type: ignore[arg-type]
    (model,) = Snapshots(metrics, [FakeRayGenerate()]).take()["models"]
    rows = [(r["index"], r["state"], r["healthy"], r["num_requests"]) for r in model["replicas"]]
    assert rows == [(2, "ready", True, 0.0), (10, "ready", True, 2.0)]  # by index
