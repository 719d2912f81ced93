"""Speculative decoding settings in vLLM's shape (pure Python).

``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
"prompt_lookup_min": M}`` proposes the K tokens that followed the last earlier occurrence
of the sequence's final n-gram (M <= n <= N); ``{"model": PATH, "num_speculative_tokens": K}``
proposes them with a smaller draft model that shares the target's tokenizer.
``"draft_length": "adaptive"`` (n-gram) makes K a ceiling: each step proposes the number
that the measured acceptance and step times say pays best. ``"burst_tokens": B`` (n-gram,
fixed draft length): a lone greedy stream's step verifies on in C until it has B tokens
(worker/spec_burst.py); 0 turns that off; the default is FLEETSERVE_SPEC_BURST's, else
32.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
DRAFT_LENGTHS = ("fixed", "adaptive")
# A verification is k + 1 rows, and only a query of at most 16 rows (paged_attention.c's
# VERIFY_ROWS) takes each row through plain decoding's attention arithmetic; 17 rows take
# the prefill tiles, whose sums differ in the last bits, and greedy tokens then part from
# plain decoding's at near-ties (k=16 did at token 59 of the spec bench's second paragraph
# on SmolLM2): k stays at most 15, so accepted tokens are exactly plain decoding's.
MAX_SPECULATIVE_TOKENS = 15
# Tokens a speculative burst decodes per scheduler step by default (worker/spec_burst.py).
DEFAULT_BURST_TOKENS = 32
MAX_BURST_TOKENS = 1024
_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "draft_length",
    "burst_tokens",
)
_PREFIX = "speculative_config"


def _int_field(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{_PREFIX}.{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model's checkpoint (method "draft_model")
    # "fixed": a multi-token n-gram match proposes num_speculative_tokens drafts;
    # "adaptive": at most that many, chosen each step from the measured acceptance by
    # position and step time by rows (draft_length.py). n-gram only.
    draft_length: str = "fixed"
    # A lone greedy stream's speculative steps run on in C up to this many tokens
    # (worker/spec_burst.py; n-gram with a fixed draft length); 0: off.
    burst_tokens: int = DEFAULT_BURST_TOKENS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"{_PREFIX}.method must be one of {METHODS}, got {self.method!r}")
        _int_field("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_field("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _int_field("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        _int_field("burst_tokens", self.burst_tokens, 0, MAX_BURST_TOKENS)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"{_PREFIX}.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError(f"{_PREFIX}.model must name the draft model's checkpoint")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(
                f"{_PREFIX}.draft_length must be one of {DRAFT_LENGTHS}, got {self.draft_length!r}"
            )
        if self.draft_length == "adaptive" and self.method != "ngram":
            raise ValueError(f"{_PREFIX}.draft_length 'adaptive' is only for method 'ngram'")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"{_PREFIX}.model is only used with method 'draft_model'")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a draft model writes past the verified tokens while proposing: its
        proposals' own K/V (an n-gram lookup writes none)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @property
    def bursts(self) -> bool:
        """Whether a lone greedy stream's steps may verify on in C (worker/spec_burst.py)."""
        return self.burst_tokens > 0 and self.method == "ngram" and self.draft_length == "fixed"

    @property
    def num_burst_lookahead_tokens(self) -> int:
        """KV slots a lone request holds past its step for a burst's verifications: a
        burst's last round starts before `burst_tokens` and writes up to k + 1 rows."""
        return self.burst_tokens + self.num_speculative_tokens if self.bursts else 0

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From the user's dict (or its JSON text, as the server flag gives it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_PREFIX} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{_PREFIX} must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{_PREFIX} has unknown fields {unknown}; known: {list(_FIELDS)}")
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{_PREFIX}.num_speculative_tokens is required")
        method = value.get("method")
        if method is None:
            method = "draft_model" if value.get("model") else "ngram"
        lo: Any = value.get("prompt_lookup_min")
        hi: Any = value.get("prompt_lookup_max")
        if lo is None:
            lo = 1 if hi is None or not isinstance(hi, int) or hi >= 1 else hi
        if hi is None:
            hi = max(lo, 4) if isinstance(lo, int) and not isinstance(lo, bool) else lo
        return cls(
            method=method,
            num_speculative_tokens=value["num_speculative_tokens"],
            prompt_lookup_max=hi,
            prompt_lookup_min=lo,
            model=value.get("model"),
            draft_length=value.get("draft_length", "fixed"),
            burst_tokens=value.get("burst_tokens", _default_burst_tokens()),
        )


def _default_burst_tokens() -> int:
    """FLEETSERVE_SPEC_BURST (A/B runs of whole trees: 0 turns bursts off), else the
    default."""
    raw = os.environ.get("FLEETSERVE_SPEC_BURST")
    if raw is None:
        return DEFAULT_BURST_TOKENS
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"FLEETSERVE_SPEC_BURST must be an integer, got {raw!r}") from None
