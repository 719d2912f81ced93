"""An engine's figures after each step (EngineCore.stats): what the core process sends its
frontend with every step's outputs, what a replica's load figures and the Prometheus
gauges read. `as_metrics()` flattens them under the series' keys (metrics.py)."""

from __future__ import annotations

import msgspec


class SpecDecodeStats(msgspec.Struct, frozen=True):
    """Speculative decoding since the engine started: verifications, draft tokens
    verified, drafts accepted, and the two ratios (accepted / proposed drafts; tokens
    emitted per verification, the target's own token included)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0

    @classmethod
    def of(cls, num_drafts: int, num_draft_tokens: int, num_accepted: int) -> SpecDecodeStats:
        return cls(
            num_drafts,
            num_draft_tokens,
            num_accepted,
            num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
            1 + num_accepted / num_drafts if num_drafts else 0.0,
        )


class EngineStats(msgspec.Struct, frozen=True):
    """One engine's latest figures; counts (`num_*`, `prefix_cache_*`) are totals since
    it started, except the request counts, which are now."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    # Prompt tokens looked up in / found in its prefix cache (a remote pod reports its
    # hit rate as one query, hence floats).
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    num_preemptions: int = 0
    last_step_seconds: float = 0.0
    num_steps: int = 0
    # Wall seconds inside steps and the tokens they ran, since start: against a run's
    # duration, how busy the engine was (the rest: waiting for requests, its own loop).
    step_seconds: float = 0.0
    num_step_tokens: int = 0
    spec_decode: SpecDecodeStats | None = None  # None: no speculative decoding
    # Structured outputs: steps and rows whose grammar masks were filled, and the time it
    # took (off the forward pass's critical path, on a helper thread).
    structured_mask_steps: int = 0
    structured_mask_rows: int = 0
    structured_mask_seconds: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        """By the Prometheus series' keys; speculative decoding's as `spec_decode_*`."""
        out: dict[str, float] = {
            f: float(getattr(self, f)) for f in self.__struct_fields__ if f != "spec_decode"
        }
        if self.spec_decode is not None:
            s = self.spec_decode
            out.update({f"spec_decode_{f}": float(getattr(s, f)) for f in s.__struct_fields__})
        return out
