"""An escalation predicate for the cascade tests (fleet file: `predicate: cascade_rules:...`)."""

from __future__ import annotations

from fleetserve.serve.pipelines.rules import CascadeAnswer


def longer_than_three(answer: CascadeAnswer) -> bool:
    return len(answer.token_ids) > 3
