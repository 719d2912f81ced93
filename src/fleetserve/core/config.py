"""Scheduler settings (pure Python, so core/ needs nothing from the rest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    # KV slots reserved past a sampling step's tokens for a draft model's proposals.
    num_lookahead_tokens: int = 0
    # KV slots a lone running request reserves past its step's tokens, for the runner's
    # speculative burst to write its next verifications in (worker/spec_burst.py).
    num_burst_lookahead_tokens: int = 0
    # LoRA: at most this many adapters among the running requests (their rows share a
    # step through the worker's slots); None: no LoRA.
    max_loras: int | None = None

    @property
    def reserves_lookahead(self) -> bool:
        """True when a step may reserve KV slots past its tokens (a draft model's proposals
        or a speculative burst's verifications): only then can a running request hold
        blocks past its last token, and only then does the scheduler size lookahead."""
        return bool(self.num_lookahead_tokens or self.num_burst_lookahead_tokens)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")
        if self.num_burst_lookahead_tokens < 0:
            raise ValueError(
                f"num_burst_lookahead_tokens must be >= 0, got {self.num_burst_lookahead_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked_prefill is off"
            )
