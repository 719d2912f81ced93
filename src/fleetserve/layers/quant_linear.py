"""Linear and embedding layers whose weights stay in a GGUF block format.

`QuantLinear` stands where a `Linear` stood: its output features are one or more row
segments, each a `QuantWeight` (a fused qkv projection is three GGUF tensors, which a
mixed-precision file may store in different block types), written side by side into one
output. `QuantEmbedding` decodes only the rows it looks up, so a tied LM head and the
embedding share one quantized copy.
"""

from __future__ import annotations

import torch
from torch import nn

from fleetserve.kernels.quant import QuantWeight, quant_embedding, quant_linear


class QuantLinear(nn.Module):
    def __init__(self, segments: list[QuantWeight], bias: bool = False) -> None:
        super().__init__()
        if not segments:
            raise ValueError("QuantLinear needs at least one weight segment")
        self.in_features = segments[0].in_features
        if any(s.in_features != self.in_features for s in segments):
            raise ValueError("every segment of a QuantLinear must take the same inputs")
        self.segments = segments
        self.out_features = sum(s.out_features for s in segments)
        # Filled by load_weights like any other parameter (qkv bias of Qwen2).
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.segments) == 1:
            return quant_linear(x, self.segments[0], self.bias)
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.out_features)
        offset = 0
        for seg in self.segments:
            quant_linear(x2, seg, out=out[:, offset : offset + seg.out_features])
            offset += seg.out_features
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = "+".join(f"{s.qtype.name}[{s.out_features}]" for s in self.segments)
        return f"in_features={self.in_features}, out={kinds}, bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.weight_q = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return quant_embedding(input_ids, self.weight_q)

    def extra_repr(self) -> str:
        w = self.weight_q
        return f"{w.out_features}, {w.in_features}, {w.qtype.name}"
