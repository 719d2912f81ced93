"""Rotary position embedding (HF "rotate half" layout) with llama3 / linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from fleetserve.forward_context import cpu_kernels_active
from fleetserve.kernels import cpu as cpu_kernels


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
        # and the band between them interpolated smoothly.
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / high) & (wavelen <= orig / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (use llama3 or linear)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # The tables are computed on the CPU whatever the default device, then moved to it.
        # Models are built under `torch.device("meta")` (worker/model_setup.py), where these
        # ops take torch's Python reference path, whose first use imports torch._dynamo
        # (~1.5 s of CPU per engine start); the real tables come from `rebuild_rope`.
        target = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq = _inv_freq(head_dim, theta, scaling)
            t = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
            cos, sin = freqs.cos(), freqs.sin()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos.to(target), persistent=False)
        self.register_buffer("sin", sin.to(target), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        if cpu_kernels_active():
            cpu_kernels.rotary(q, k, positions, self.cos, self.sin)  # in place
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
