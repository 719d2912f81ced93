"""EngineStats: the core's figures as one typed struct across the process boundary, and
their flat form under the Prometheus series' keys."""

from __future__ import annotations

import msgspec

from fleetserve.engine.stats import EngineStats, SpecDecodeStats
from fleetserve.engine.wire import CoreMessage, CoreOutputs
from fleetserve.metrics import _COUNTERS, _GAUGES


def test_stats_cross_the_wire_typed() -> None:
    stats = EngineStats(num_requests_running=2, kv_cache_usage_perc=0.25, num_steps=7,
                        spec_decode=SpecDecodeStats.of(4, 12, 9))  # fmt: skip
    raw = msgspec.msgpack.encode(CoreOutputs([], stats, []))
    back = msgspec.msgpack.decode(raw, type=CoreMessage)  # type: ignore[arg-type]
    assert isinstance(back, CoreOutputs) and back.stats == stats
    assert back.stats.spec_decode is not None and back.stats.spec_decode.acceptance_rate == 0.75


def test_spec_decode_ratios() -> None:
    assert SpecDecodeStats.of(4, 12, 9) == SpecDecodeStats(4, 12, 9, 0.75, 1 + 9 / 4)
    assert SpecDecodeStats.of(0, 0, 0) == SpecDecodeStats()


def test_as_metrics_feeds_every_engine_series() -> None:
    plain = EngineStats(num_preemptions=3, prefix_cache_hit_rate=0.5).as_metrics()
    assert not any(k.startswith("spec_decode") for k in plain)
    assert plain["num_preemptions"] == 3.0 and plain["prefix_cache_hit_rate"] == 0.5
    full = EngineStats(spec_decode=SpecDecodeStats.of(1, 2, 1)).as_metrics()
    # Every gauge and counter metrics.py exports has its key (none is silently left at 0).
    assert set(_GAUGES) | set(_COUNTERS) <= set(full)
    assert full["spec_decode_num_accepted_tokens"] == 1.0
