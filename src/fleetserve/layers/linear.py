"""Linear layers whose weight can be repacked for the CPU GEMM kernel.

On the CPU kernel path (float32 on the CPU, C kernels built) the model runner calls
``pack_for_cpu`` on every `Linear` after loading: the weight moves into the kernel's
panel layout (fleetserve/kernels/gemm.c) and the row-major copy is dropped, so packing
costs no memory. Elsewhere (GPU, other dtypes, the torch backend) `Linear` is plain
``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.kernels import cpu as cpu_kernels


class Linear(nn.Linear):
    packed: cpu_kernels.PackedWeight | None = None

    def pack_for_cpu(self) -> None:
        if self.packed is None:
            self.packed = cpu_kernels.PackedWeight(self.weight)
            # An empty stand-in: the packed copy is the weight from now on.
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> None:
    """Pack every `Linear` of ``model`` for the CPU kernel."""
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.pack_for_cpu()
