"""Linear layers whose weight can be repacked for the CPU GEMM kernel.

On the CPU kernel path (float32 on the CPU, C kernels built) the model runner calls
``pack_for_cpu`` on every `Linear` after loading: the weight moves into the kernel's
panel layout (fleetserve/kernels/gemm.c) and the row-major copy is dropped, so packing
costs no memory. With bf16 weights (`to_bf16`, the engine's `bf16_weights`) the weight is
kept as [out, in] bfloat16 instead, half the bytes, and multiplied through
kernels/gemm_bf16.c (activations rounded to bf16, float32 sums and outputs); where AMX
runs, a weight whose shape tiles is laid out as AMX B tiles instead (kernels/bf16.py
`layout_bf16`, the only copy kept). Elsewhere (GPU, other dtypes, the torch backend) `Linear` is plain
``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import Bf16Weight, gemm_bf16, layout_bf16


class Linear(nn.Linear):
    packed: cpu_kernels.PackedWeight | None = None
    bf16: Bf16Weight | None = None

    def to_bf16(self) -> None:
        """Keep the weight as bfloat16 in the layout this CPU multiplies fastest (AMX
        tiles, or contiguous rows: kernels/bf16.py `layout_bf16`) and multiply through
        gemm_bf16."""
        if self.bf16 is None and self.packed is None:
            self.bf16 = layout_bf16(self.weight)
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def pack_for_cpu(self) -> None:
        if self.packed is None and self.bf16 is None:
            self.packed = cpu_kernels.PackedWeight(self.weight)
            # An empty stand-in: the packed copy is the weight from now on.
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.packed_linear(x, self.packed, self.bias)
        if self.bf16 is not None:
            x2 = x.reshape(-1, self.bf16.shape[1])
            if x2.stride(1) != 1:
                x2 = x2.contiguous()
            bias = None if self.bias is None else self.bias.detach()
            # Every row count through gemm_bf16 (AMX tiles for many rows where present),
            # as the C step's W_BF16 share: the two paths agree bit for bit.
            out = gemm_bf16(x2, self.bf16, bias=bias)
            return out.view(*x.shape[:-1], self.bf16.shape[0])
        return F.linear(x, self.weight, self.bias)


def linears_to_bf16(model: nn.Module) -> None:
    """Store every `Linear` of ``model`` in bf16 (see `Linear.to_bf16`)."""
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.to_bf16()


def pack_linears(model: nn.Module) -> None:
    """Pack every `Linear` of ``model`` for the CPU kernel."""
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.pack_for_cpu()
