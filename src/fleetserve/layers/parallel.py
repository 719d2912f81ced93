"""Tensor-parallel layers: each rank holds a slice of the weight and communicates once.

Column-parallel projections (fused q/k/v, gate/up) need no layer of their own: a plain
`Linear` over this rank's output rows. What follows them is row-parallel (o_proj,
down_proj): a partial product over this rank's input columns, summed across ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.distributed.parallel_state import ParallelContext, vocab_range
from fleetserve.layers.linear import Linear


class RowParallelLinear(Linear):
    """y = all_reduce(x_shard @ W_shard^T): x and W are split along the input features."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids inside its vocab slice (zeros elsewhere); the sum across
    ranks is the full lookup. `weight` rows are padded to equal shards (see vocab_range)."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.start, self.end, rows = vocab_range(vocab_size, ctx.tp_size, ctx.tp_rank)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        return self.ctx.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class LogitsGather(nn.Module):
    """[num_rows, shard] logits of this rank's vocab slice -> [num_rows, vocab_size]."""

    def __init__(self, vocab_size: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ctx = ctx

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_gather_last_dim(logits)[..., : self.vocab_size]
