"""Escalation rules: whether a tier's answer (whole, or its first K tokens) goes up a tier."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetserve.outputs import CompletionOutput
from fleetserve.serve.pipelines.cascade_config import EscalateConfig


@dataclass(frozen=True)
class CascadeAnswer:
    """What a rule sees of one choice of a tier's answer. `complete`: it finished (False
    when judged on its first decide_after_tokens tokens)."""

    tier: str
    text: str
    token_ids: tuple[int, ...]
    mean_logprob: float | None
    finish_reason: str | None
    complete: bool


def answer_of(tier: str, c: CompletionOutput) -> CascadeAnswer:
    lps = [lp.get(t) for t, lp in zip(c.token_ids, c.logprobs or [], strict=False)]
    known = [x for x in lps if x is not None]
    mean = sum(known) / len(known) if known else None
    return CascadeAnswer(
        tier, c.text, tuple(c.token_ids), mean, c.finish_reason, c.finish_reason is not None
    )


def load_predicate(spec: str) -> Callable[[CascadeAnswer], Any]:
    """'package.module:function' -> the function; ValueError naming what is wrong."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"escalate.predicate {spec!r}: importing {module_name!r} failed: {e}"
        ) from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)  # type: ignore[assignment]
        if fn is None:
            raise ValueError(f"escalate.predicate {spec!r}: {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"escalate.predicate {spec!r} is not callable")
    return fn  # type: ignore[return-value]


class Rules:
    """The cascade's escalation rule, ready to judge (regex compiled, predicate imported)."""

    def __init__(self, cfg: EscalateConfig) -> None:
        self.cfg = cfg
        self.regex = re.compile(cfg.must_match) if isinstance(cfg.must_match, str) else None
        self.schema = None
        if isinstance(cfg.must_match, dict):
            from jsonschema import Draft202012Validator

            self.schema = Draft202012Validator(cfg.must_match)
        self.predicate = load_predicate(cfg.predicate) if cfg.predicate else None

    @property
    def needs_logprobs(self) -> bool:
        return self.cfg.min_mean_logprob is not None

    @property
    def reasons(self) -> list[str]:
        """Every reason a rule may give (the metric's labels)."""
        cfg = self.cfg
        out = ["min_mean_logprob"] if cfg.min_mean_logprob is not None else []
        out += ["max_tokens_hit"] if cfg.max_tokens_hit else []
        out += ["must_match"] if cfg.must_match is not None else []
        return out + (["predicate"] if cfg.predicate else [])

    def judge(self, a: CascadeAnswer) -> str | None:
        """The first rule that says escalate, or None to accept the answer."""
        cfg = self.cfg
        floor = cfg.min_mean_logprob
        if floor is not None and (a.mean_logprob is None or a.mean_logprob < floor):
            return "min_mean_logprob"
        if cfg.max_tokens_hit and a.finish_reason == "length":
            return "max_tokens_hit"
        if self.regex is not None and self.regex.search(a.text) is None:
            return "must_match"
        if self.schema is not None and not self._fits_schema(a.text):
            return "must_match"
        if self.predicate is not None and self.predicate(a):
            return "predicate"
        return None

    def _fits_schema(self, text: str) -> bool:
        assert self.schema is not None
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return bool(self.schema.is_valid(value))
