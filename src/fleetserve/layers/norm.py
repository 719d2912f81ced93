"""RMSNorm computed in float32 like the reference implementations.

``forward_residual`` folds the residual add that precedes every norm inside a decoder
layer into the norm: on the CPU kernel path both happen in one C pass, the residual
updated in place.
"""

from __future__ import annotations

import torch

from fleetserve.forward_context import cpu_kernels_active
from fleetserve.kernels import cpu as cpu_kernels


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels_active() and x.dim() == 2:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        if cpu_kernels_active() and x.dim() == 3:
            # Per-head norm (Qwen3's q/k): the C path, so that the fused decode step
            # (kernels/decode_step.c), which runs the same row code, matches it exactly.
            return cpu_kernels.rms_norm_heads(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). ``residual`` may be updated in place."""
        if cpu_kernels_active():
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self.forward(residual), residual
