"""LoRALinear: a base projection plus the LoRA delta of each row's adapter slot.

The base layer is untouched (a packed `Linear`, a `QuantLinear` of GGUF / int8 blocks, or
a tensor-parallel shard), so LoRA works over every weight format the engine loads. The
delta is added to the base's output in place; a row-parallel layer (o_proj, down_proj
under TP) adds it to its partial sum before the all-reduce, since each rank holds only
its input columns of A.
"""

from __future__ import annotations

import torch
from torch import nn

from fleetserve.layers.linear import Linear
from fleetserve.layers.parallel import RowParallelLinear
from fleetserve.lora.context import lora_rows
from fleetserve.lora.kernel import apply_lora


class LoRALinear(nn.Module):
    """`base` with `max_loras` slots of stacked LoRA pairs (see kernels/lora.c):
    a [slots, num_segs * max_rank, in_features], b [slots, max_rank, out_features] (B
    transposed: the kernel's expand is then contiguous axpys)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        seg_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.seg_sizes = list(seg_sizes)
        self.out_features = sum(seg_sizes)
        self.max_rank = max_rank
        num_segs = len(seg_sizes)
        starts = [0]
        for n in seg_sizes:
            starts.append(starts[-1] + n)
        # Plain tensors, not parameters: they are state the slot pool writes, never loaded
        # from the base checkpoint.
        self.seg_starts = torch.tensor(starts, dtype=torch.int64)
        self.a = torch.zeros(
            max_loras, num_segs * max_rank, in_features, dtype=dtype, device=device
        )
        self.b = torch.zeros(max_loras, max_rank, self.out_features, dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, num_segs, dtype=torch.int32)
        # Per slot: whether its adapter targets this module at all (a step whose slots
        # leave it alone skips the kernel call).
        self.slot_used = [False] * max_loras
        self.use_c = True

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (a [r, in], b [out_seg, r]) pair per segment (None: the
        adapter leaves that segment alone)."""
        r_max = self.max_rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.slot_used[slot] = any(pair is not None for pair in pairs)
        for g, pair in enumerate(pairs):
            if pair is None:
                self.ranks[slot, g] = 0
                continue
            a, b = pair
            r = a.shape[0]
            lo, hi = int(self.seg_starts[g]), int(self.seg_starts[g + 1])
            assert a.shape == (r, self.in_features) and b.shape == (hi - lo, r), (a.shape, b.shape)
            self.a[slot, g * r_max : g * r_max + r].copy_(a)
            self.b[slot, :r, lo:hi].copy_(b.T)
            self.ranks[slot, g] = r

    def clear_slot(self, slot: int) -> None:
        self.ranks[slot].zero_()
        self.slot_used[slot] = False

    def _add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        groups = lora_rows()
        if groups is None or not any(self.slot_used[s] for s in groups.slot_list):
            return
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y2 = y.view(-1, self.out_features)
        apply_lora(x2, y2, self.a, self.b, self.ranks, self.seg_starts, groups, self.use_c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if isinstance(base, RowParallelLinear):
            if lora_rows() is None:
                return base(x)
            partial = Linear.forward(base, x)  # this rank's share, not yet reduced
            self._add_delta(x, partial)
            return base.ctx.all_reduce(partial)
        y = base(x)
        if not y.is_contiguous():
            y = y.contiguous()
        self._add_delta(x, y)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, segments={self.seg_sizes}, slots={self.a.shape[0]}, "
            f"max_rank={self.max_rank}"
        )
