"""CascadeService: `kind: cascade`, a model name served by its tiers' GenerateServices.

A request runs on the first tier; when the escalation rule (rules.py) fires on its answer,
it runs again on the next tier, and so on; the last tier's answer is always taken. Each try
is an ordinary admission to the tier's own service (its class queues, routing, migration
and metrics, under the tier's model_name) with the request's class; the HTTP side is
entrypoints/openai/serving_cascade.py. The service itself holds no replica: it is ready
when its tiers are, and its metrics count requests and tokens per tier and escalations per
reason.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from fleetserve.metrics import ModelMetrics
from fleetserve.serve.pipelines.composite import Composite
from fleetserve.serve.pipelines.rules import Rules

_FAMILIES: dict[int, tuple[Counter, Counter, Counter]] = {}


def _families(metrics: ModelMetrics) -> tuple[Counter, Counter, Counter]:
    """The cascade metric families, one set per server registry."""
    key = id(metrics.registry)
    if key not in _FAMILIES:
        r, labels = metrics.registry, ["model_name", "tier"]
        _FAMILIES[key] = (
            Counter("fleetserve:cascade_requests", "Cascade answers, by the tier that gave them.",
                    labels, registry=r),
            Counter("fleetserve:cascade_tokens", "Tokens a cascade's tiers generated (accepted "
                    "or escalated), by tier.", labels, registry=r),
            Counter("fleetserve:cascade_escalations", "Answers a tier gave that went up a tier, "
                    "by the tier and the rule that fired.", [*labels, "reason"], registry=r),
        )  # fmt: skip
    return _FAMILIES[key]


class CascadeService(Composite):
    kind = "cascade"

    def __init__(
        self,
        name: str,
        tiers: list[str],
        rules: Rules,
        decide_after_tokens: int | None,
        metrics: ModelMetrics,
    ) -> None:
        self.name = name
        self.tier_names = list(tiers)
        self.rules = rules
        self.decide_after_tokens = decide_after_tokens
        self.tiers: list[Any] = []  # the tiers' GenerateServices, set by bind()
        self._in_flight = 0
        requests, tokens, escalations = _families(metrics)
        self._requests = {t: requests.labels(name, t) for t in tiers}
        self._tokens = {t: tokens.labels(name, t) for t in tiers}
        self._escalations = {
            (t, reason): escalations.labels(name, t, reason)
            for t in tiers[:-1]
            for reason in rules.reasons
        }

    def bind(self, services: dict[str, Any]) -> None:
        """Takes its tiers' services from the registry (the config checked they exist)."""
        self.tiers = [services[t] for t in self.tier_names]

    # ------------------------------------------------------------- what requests do
    def count_answer(self, tier: str) -> None:
        self._requests[tier].inc()

    def count_tokens(self, tier: str, num_tokens: int) -> None:
        self._tokens[tier].inc(num_tokens)

    def count_escalation(self, tier: str, reason: str) -> None:
        self._escalations[(tier, reason)].inc()

    def enter(self) -> None:
        self._in_flight += 1

    def leave(self) -> None:
        self._in_flight -= 1

    # ------------------------------------------------------------- ModelService
    @property
    def is_ready(self) -> bool:
        return bool(self.tiers) and all(t.is_ready for t in self.tiers)

    def card(self) -> dict[str, Any]:
        return {"tiers": self.tier_names, "escalate": self.rules.cfg.model_dump()}

    def waiting_by_class(self) -> dict[str, int]:
        return {}
