"""The grouped shrink/expand of one LoRA module: kernels/lora.c, or the torch reference.

Both take the same arguments (see kernels/lora.c for the layout): the C kernel where
the library is built and the activations are float32 on the CPU (the slots' A and B
float32 or bfloat16), torch elsewhere (and in tests, as the reference the kernel is
checked against).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from fleetserve.kernels import cpu as cpu_kernels


@dataclass(frozen=True)
class RowGroups:
    """A step's LoRA rows grouped by slot: group i is rows[starts[i]:starts[i + 1]],
    all of slot slots[i]. Rows of the base model are in no group."""

    rows: torch.Tensor  # int64 [num_lora_rows]
    starts: torch.Tensor  # int64 [num_groups + 1]
    slots: torch.Tensor  # int32 [num_groups]
    slot_list: tuple[int, ...]  # the same slots, for the torch path
    start_list: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.slot_list)

    @property
    def num_rows(self) -> int:
        return self.start_list[-1]


def group_rows(row_slots: list[int | None]) -> RowGroups | None:
    """Rows -> groups by slot (None: a base-model row). None when no row has a slot."""
    by_slot: dict[int, list[int]] = {}
    for i, s in enumerate(row_slots):
        if s is not None:
            by_slot.setdefault(s, []).append(i)
    if not by_slot:
        return None
    rows: list[int] = []
    starts = [0]
    slots = sorted(by_slot)
    for s in slots:
        rows.extend(by_slot[s])
        starts.append(len(rows))
    return RowGroups(
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int32),
        tuple(slots),
        tuple(starts),
    )


@cache
def _lib() -> ctypes.CDLL | None:
    lib = cpu_kernels.load()
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.lora_shrink_expand.argtypes = [
        p, i64, p, i64, i64, i64, p, p, p, i64, i32, p, p, p, p, i32, p, i32, i32,
    ]  # fmt: skip
    lib.lora_shrink_expand.restype = None
    return lib


def apply_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    groups: RowGroups,
    use_c: bool = True,
) -> None:
    """y[rows] += each row's slot's B (A x) in place.

    x [num_rows, in_dim], y [num_rows, out_dim] (rows contiguous), a [num_slots,
    num_segs * max_rank, in_dim], b [num_slots, max_rank, out_dim] (B transposed), ranks int32
    [num_slots, num_segs], seg_starts int64 [num_segs + 1]."""
    lib = _lib() if use_c else None
    if (
        lib is None
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or a.dtype not in _C_WEIGHT_DTYPES
        or b.dtype != a.dtype
    ):
        _apply_torch(x, y, a, b, seg_starts, groups)
        return
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    num_segs = seg_starts.numel() - 1
    max_rank = b.shape[1]
    shrunk = torch.empty(groups.num_rows, num_segs * max_rank, dtype=torch.float32)
    lib.lora_shrink_expand(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], y.shape[1],
        a.data_ptr(), b.data_ptr(), ranks.data_ptr(), max_rank, num_segs,
        seg_starts.data_ptr(), groups.rows.data_ptr(), groups.starts.data_ptr(),
        groups.slots.data_ptr(), groups.num_groups, shrunk.data_ptr(),
        _num_threads(groups.num_rows * (a.shape[1] * x.shape[1] + max_rank * y.shape[1])),
        int(a.dtype == torch.bfloat16),
    )  # fmt: skip


_C_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def c_kernel_available() -> bool:
    return _lib() is not None


# Below this many multiply-adds a call runs on one thread: a decode step's LoRA work is
# ~0.1 ms, and splitting it costs two barriers, which on a busy machine (a descheduled
# partner thread) cost more than the work itself.
_PARALLEL_MIN_MACS = 4_000_000


def _num_threads(macs: int) -> int:
    return 1 if macs < _PARALLEL_MIN_MACS else torch.get_num_threads()


def _apply_torch(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    groups: RowGroups,
) -> None:
    """The reference: slots hold zeros past each segment's rank, so plain matmuls do."""
    max_rank = b.shape[1]
    bounds = seg_starts.tolist()
    for i, slot in enumerate(groups.slot_list):
        rows = groups.rows[groups.start_list[i] : groups.start_list[i + 1]].to(x.device)
        a_s, b_s = a[slot].to(x.dtype), b[slot].to(x.dtype)
        shrunk = x[rows] @ a_s.T  # [n, num_segs * max_rank]
        for g in range(len(bounds) - 1):
            s = shrunk[:, g * max_rank : (g + 1) * max_rank]
            delta = s @ b_s[:, bounds[g] : bounds[g + 1]]
            y[rows, bounds[g] : bounds[g + 1]] += delta.to(y.dtype)
