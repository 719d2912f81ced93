"""LoRA inside the C step: the step's adapter rows carried into kernels/decode_step.c.

Without this a step with adapter rows left the C step for the module path, whose small
LoRA calls ran on one thread between the base GEMMs. Here the plan's projections (qkv, o,
gate_up, down of each layer) are paired with their `LoRALinear` slots once, and each
step hands over only its rows grouped by slot: every thread of the step's team takes a
share of the shrink beside the projection's GEMM share and a share of the expand's output
columns after it (kernels/lora.c, `lora_step_shrink` / `lora_step_expand`). The
arithmetic per element is the module path's (`lora_shrink_expand`), so both paths give
the same rows.
"""

from __future__ import annotations

import ctypes

import torch

from fleetserve.lora.kernel import RowGroups
from fleetserve.lora.layers import LoRALinear

_p, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
# The plan's projections of a layer, in lora.c's order.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class _Proj(ctypes.Structure):
    _fields_ = [
        ("a", _p), ("b", _p), ("ranks", _p), ("seg_starts", _p), ("max_rank", _i64),
        ("num_segs", _i32), ("half", _i32),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("projs", _p), ("rows", _p), ("group_starts", _p), ("group_slots", _p),
        ("num_groups", _i32), ("shrunk", _p),
    ]  # fmt: skip


def fusable(module: LoRALinear) -> bool:
    """Whether the C step can apply this module's slots (what `apply_lora`'s C path takes)."""
    return (
        module.a.device.type == "cpu"
        and module.a.dtype in (torch.float32, torch.bfloat16)
        and module.b.dtype == module.a.dtype
        and module.a.is_contiguous()
        and module.b.is_contiguous()
    )


class FusedLoRA:
    """The slots of every layer's four projections, as lora.c's `lora_step` reads them.

    `layers[i]` maps a projection name of PROJECTIONS to layer i's `LoRALinear`. The slot
    tensors are written in place (LoRALinear.set_slot), so their addresses hold."""

    def __init__(self, layers: list[dict[str, LoRALinear]]) -> None:
        self._keep: list[LoRALinear] = []
        self._projs = (_Proj * (4 * len(layers)))()
        self.max_width = 0
        for i, by_name in enumerate(layers):
            for j, name in enumerate(PROJECTIONS):
                module = by_name[name]
                if not fusable(module):
                    raise ValueError(f"layer {i} {name}: slots the C step cannot read")
                num_segs = module.seg_starts.numel() - 1
                self._projs[4 * i + j] = _Proj(
                    module.a.data_ptr(), module.b.data_ptr(), module.ranks.data_ptr(),
                    module.seg_starts.data_ptr(), module.max_rank, num_segs,
                    int(module.a.dtype == torch.bfloat16),
                )  # fmt: skip
                self.max_width = max(self.max_width, num_segs * module.max_rank)
                self._keep.append(module)
        self._step = _Step()
        self._step.projs = ctypes.addressof(self._projs)
        self._groups: RowGroups | None = None
        self._shrunk = torch.empty(0)

    def step(self, groups: RowGroups) -> int:
        """The address of this step's `lora_step` (valid until the next call)."""
        need = groups.num_rows * self.max_width
        if self._shrunk.numel() < need:
            self._shrunk = torch.empty(max(need, 2 * self._shrunk.numel()))
        self._groups = groups  # its tensors stay alive while the C step reads them
        st = self._step
        st.rows = groups.rows.data_ptr()
        st.group_starts = groups.starts.data_ptr()
        st.group_slots = groups.slots.data_ptr()
        st.num_groups = groups.num_groups
        st.shrunk = self._shrunk.data_ptr()
        return ctypes.addressof(st)
