"""An escalation predicate for the cascade tests (fleet file: `predicate: cascade_rules:...`)."""

from __future__ import annotations

import time

from fleetserve.serve.pipelines.rules import CascadeAnswer

SLOW_S = 0.8


def longer_than_three(answer: CascadeAnswer) -> bool:
    return len(answer.token_ids) > 3


def slow_then_up(answer: CascadeAnswer) -> bool:
    """Escalates every answer after SLOW_S: a first tier that takes at least that long."""
    time.sleep(SLOW_S)
    return True
