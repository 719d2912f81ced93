"""The fleet file's keys of a `kind: cascade` model (checked at load)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

_PREDICATE = re.compile(r"^[\w.]+:[\w.]+$")


class EscalateConfig(BaseModel):
    """When an answer goes to the next tier; any rule that fires escalates.

    min_mean_logprob: the answer's mean token logprob is below it.
    max_tokens_hit: the answer stopped at max_tokens (finish_reason "length").
    must_match: a regex the answer must contain (a string), or a JSON schema the answer,
      parsed as JSON, must satisfy (a mapping).
    predicate: 'package.module:function', called with a CascadeAnswer; truthy escalates.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    min_mean_logprob: float | None = None
    max_tokens_hit: bool = False
    must_match: str | dict[str, Any] | None = None
    predicate: str | None = None

    @model_validator(mode="after")
    def _check(self) -> EscalateConfig:
        if (
            self.min_mean_logprob is None
            and not self.max_tokens_hit
            and self.must_match is None
            and self.predicate is None
        ):
            raise ValueError(
                "at least one rule is needed: min_mean_logprob, max_tokens_hit, must_match "
                "or predicate"
            )
        if isinstance(self.must_match, str):
            try:
                re.compile(self.must_match)
            except re.error as e:
                raise ValueError(f"must_match is not a valid regex: {e}") from None
        elif isinstance(self.must_match, dict):
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(self.must_match)
            except SchemaError as e:
                raise ValueError(f"must_match is not a valid JSON schema: {e.message}") from None
        if self.predicate is not None and not _PREDICATE.match(self.predicate):
            raise ValueError("predicate must look like 'package.module:function'")
        return self

    @property
    def needs_whole_answer(self) -> list[str]:
        """The rules that can only judge a finished answer."""
        out = ["max_tokens_hit"] if self.max_tokens_hit else []
        return out + (["must_match"] if self.must_match is not None else [])


def check_cascade(
    kind: str,
    tiers: list[str] | None,
    escalate: EscalateConfig | None,
    decide_after_tokens: int | None,
) -> None:
    """A model entry's cascade keys, alone (FleetConfig checks the tiers exist)."""
    if kind != "cascade":
        if tiers is not None or escalate is not None or decide_after_tokens is not None:
            raise ValueError(
                f"tiers, escalate, decide_after_tokens: for kind 'cascade', not {kind!r}"
            )
        return
    if tiers is None or len(tiers) < 2:
        raise ValueError("tiers: a cascade needs at least two tiers (generate models)")
    if len(set(tiers)) != len(tiers):
        raise ValueError("tiers: a model appears twice")
    if escalate is None:
        raise ValueError("escalate: a cascade needs its escalation rule")
    whole = escalate.needs_whole_answer
    if decide_after_tokens is not None and whole:
        raise ValueError(
            f"decide_after_tokens judges a partial answer; escalate.{whole[0]} needs the "
            "whole answer"
        )


def check_tiers(index: int, name: str, tiers: list[str], kinds: Mapping[str, str]) -> None:
    """Every tier is a generate model of the fleet; ValueError with the key path."""
    for j, tier in enumerate(tiers):
        where = f"models[{index}].tiers[{j}] (model {name!r})"
        if tier not in kinds:
            raise ValueError(f"{where}: no model {tier!r} in this fleet")
        if kinds[tier] != "generate":
            raise ValueError(
                f"{where}: {tier!r} is a {kinds[tier]} model; tiers are generate models"
            )
