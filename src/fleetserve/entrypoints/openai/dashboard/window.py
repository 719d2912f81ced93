"""Recent-window figures from the server's own metrics registry: counter rates and
histogram quantiles over the last N seconds, as Prometheus' `rate()` and
`histogram_quantile()` would give them, without a Prometheus.

The registry holds running totals only, so `History` keeps timed copies of them (taken
when the dashboard asks, at most one per `min_spacing_s`) and a `Window` is the
difference between now and the copy from about N seconds ago.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.registry import CollectorRegistry


# One sample: its name (e.g. "fleetserve:prompt_tokens_total") and sorted labels.
@dataclass(frozen=True)
class Totals:
    """Every sample of a registry at one moment, indexed by sample name."""

    t: float  # monotonic seconds
    by_name: Mapping[str, Mapping[tuple[tuple[str, str], ...], float]]

    def get(self, name: str, labels: tuple[tuple[str, str], ...]) -> float | None:
        return self.by_name.get(name, {}).get(labels)

    def select(
        self, name: str, match: Mapping[str, str]
    ) -> Iterable[tuple[dict[str, str], tuple[tuple[str, str], ...], float]]:
        """(labels, key, value) of the samples of `name` whose labels include `match`."""
        for key, value in self.by_name.get(name, {}).items():
            labels = dict(key)
            if all(labels.get(k) == v for k, v in match.items()):
                yield labels, key, value

    def total(self, name: str, **match: str) -> float:
        return sum(v for _, _, v in self.select(name, match))


def read_totals(registry: CollectorRegistry, t: float) -> Totals:
    by_name: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in registry.collect():
        for s in family.samples:
            by_name.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return Totals(t, by_name)


class History:
    """Timed totals, newest last; enough of them to reach `horizon_s` back."""

    def __init__(self, horizon_s: float, min_spacing_s: float = 0.5) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s = horizon_s
        self.min_spacing_s = min_spacing_s
        self._samples: deque[Totals] = deque()

    def add(self, totals: Totals) -> None:
        if self._samples and totals.t - self._samples[-1].t < self.min_spacing_s:
            return  # several viewers polling: one copy per spacing is enough
        self._samples.append(totals)
        # Keep the newest sample that is at least horizon_s old: it is the baseline of
        # the longest window; anything older is dropped.
        while len(self._samples) > 1 and totals.t - self._samples[1].t >= self.horizon_s:
            self._samples.popleft()

    def window(self, now: Totals, seconds: float) -> Window:
        """Now against the newest copy at least `seconds` old (else the oldest one)."""
        base = self._samples[0] if self._samples else now
        for sample in self._samples:  # oldest first
            if now.t - sample.t < seconds:
                break
            base = sample
        return Window(base, now)


@dataclass(frozen=True)
class Window:
    base: Totals
    now: Totals

    @property
    def seconds(self) -> float:
        return self.now.t - self.base.t

    def increase(self, name: str, **match: str) -> float:
        """How much the counters `name` matching `match` grew (summed); a series that is
        new since the base (a replica started) counts from 0, one that went down (it
        restarted) from its new value, as Prometheus' increase() does."""
        grown = 0.0
        for _, key, value in self.now.select(name, match):
            before = self.base.get(name, key) or 0.0
            grown += value - before if value >= before else value
        return grown

    def rate(self, name: str, **match: str) -> float | None:
        """Per second over the window; None until the window spans some time."""
        if self.seconds <= 0:
            return None
        return self.increase(name, **match) / self.seconds

    def quantile(self, q: float, histogram: str, **match: str) -> float | None:
        """The q-quantile of the observations of `histogram` (e.g.
        "fleetserve:time_to_first_token_seconds") made in the window; None if none."""
        buckets: dict[float, float] = {}
        for labels, key, value in self.now.select(histogram + "_bucket", match):
            before = self.base.get(histogram + "_bucket", key) or 0.0
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + (value - before if value >= before else value)
        return bucket_quantile(q, buckets)


def bucket_quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts {upper bound: count}:
    find the bucket holding rank q * total and interpolate linearly inside it (the first
    bucket starts at 0; a rank in the +Inf bucket answers the highest finite bound)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    bounds = sorted(cumulative)
    if not bounds or not math.isinf(bounds[-1]):
        return None  # a histogram always has +Inf; without it the data is not one
    total = cumulative[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = cumulative[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            # min(): rounding must not carry the estimate past its bucket's bound.
            return min(upper, lower + (upper - lower) * (rank - below) / (count - below))
        lower, below = upper, count
    return lower
