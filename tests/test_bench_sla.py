"""bench sla: the nearest-rank percentile (the figures in docs/benchmarks.md use it) and
the --phases list."""

from __future__ import annotations

import pytest

from fleetserve.bench.sla import parse_phases, percentile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([3.0], 99, 3.0),
        ([5.0, 1.0, 4.0, 2.0, 3.0], 50, 3.0),
        ([5.0, 1.0, 4.0, 2.0, 3.0], 99, 5.0),
        ([5.0, 1.0, 4.0, 2.0, 3.0], 0, 1.0),
        (list(map(float, range(1, 101))), 99, 99.0),
        (list(map(float, range(1, 101))), 90, 90.0),
    ],
)
def test_percentile_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


def test_phases_are_checked_and_kept_in_order() -> None:
    assert parse_phases("idle, classes") == ["idle", "classes"]
    assert parse_phases("classes,idle,one-class") == ["classes", "idle", "one-class"]
    with pytest.raises(ValueError, match="--phases: busy; choose from"):
        parse_phases("idle,busy")
    with pytest.raises(ValueError, match="--phases: none given"):
        parse_phases(" , ")
