"""The grouped-experts kernel (moe.c): one GEMM per expert over the tokens routed to it.

`ExpertWeights` holds one layer's local experts as the C kernel takes them: each expert's
gate/up projection (one float32 `PackedWeight`, or one or two GGUF `QuantWeight`
segments) and its down projection. `grouped_experts` runs the layer's routed experts for
a batch given its top-k ids and weights; `grouped_experts_torch` is the plain-torch
reference with the same grouping (and the path on GPUs, other dtypes, no compiler).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.quant import QuantWeight

Weight = cpu_kernels.PackedWeight | QuantWeight


class _MoEWeight(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("row_bytes", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("kind", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


@cache
def _lib() -> ctypes.CDLL:
    lib = cpu_kernels.load()
    if lib is None:
        raise RuntimeError("the grouped-experts kernel needs the CPU kernels (a C compiler)")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.moe_grouped.argtypes = [
        p, i64, i64, i64, i64,  # x, ldx, tokens, hidden, expert intermediate
        p, p, i64, i64, i64,  # ids, weights, top-k, first local expert, local experts
        p, i32, p, p, i32,  # gate_up weights, segments per expert, down weights, out, threads
    ]  # fmt: skip
    lib.moe_grouped.restype = i32
    return lib


def _describe(w: Weight) -> _MoEWeight:
    if isinstance(w, QuantWeight):
        return _MoEWeight(w.data_ptr, w.row_bytes, w.out_features, w.qtype_id, 0)
    return _MoEWeight(w.data.data_ptr(), 0, w.out_features, -1, 0)


@dataclass(frozen=True)
class ExpertWeights:
    """The local experts of one layer in the C kernel's form. gate_up[e]: the segments of
    expert e's [2 * inter, hidden] projection (gate rows first), all experts with the
    same number of segments; down[e]: its [hidden, inter] projection."""

    gate_up: list[list[Weight]]
    down: list[Weight]
    hidden_size: int
    intermediate_size: int

    def __post_init__(self) -> None:
        nseg = {len(s) for s in self.gate_up}
        if len(nseg) != 1 or len(self.gate_up) != len(self.down) or not self.down:
            raise ValueError("every expert needs the same number of gate_up segments and a down")
        for segs, down in zip(self.gate_up, self.down, strict=True):
            if sum(s.out_features for s in segs) != 2 * self.intermediate_size:
                raise ValueError("gate_up segments must add up to 2 * intermediate_size rows")
            if down.out_features != self.hidden_size or down.in_features != self.intermediate_size:
                raise ValueError("down must be [hidden_size, intermediate_size]")
        # ctypes arrays built once: the kernel is called once per layer per step.
        flat = [_describe(s) for segs in self.gate_up for s in segs]
        object.__setattr__(self, "_gate_up_c", (_MoEWeight * len(flat))(*flat))
        object.__setattr__(
            self, "_down_c", (_MoEWeight * len(self.down))(*[_describe(d) for d in self.down])
        )

    @property
    def num_local(self) -> int:
        return len(self.down)


def grouped_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: ExpertWeights,
    first_expert: int = 0,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for the experts in
    [first_expert, first_expert + num_local); others contribute nothing. x: [T, hidden]
    float32; topk_ids int64 and topk_weights float32: [T, K]. Returns [T, hidden]."""
    t, h = x.shape
    if h != experts.hidden_size or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU [tokens, {experts.hidden_size}] matrix")
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    if ids.shape != wts.shape or ids.dim() != 2 or ids.shape[0] != t:
        raise ValueError("topk_ids and topk_weights must both be [tokens, top_k]")
    out = torch.empty(t, h)
    if t == 0:
        return out
    rc = _lib().moe_grouped(
        x.data_ptr(), x.stride(0), t, h, experts.intermediate_size, ids.data_ptr(),
        wts.data_ptr(), ids.shape[1], first_expert, experts.num_local,
        experts._gate_up_c, len(experts.gate_up[0]), experts._down_c,  # type: ignore[attr-defined]
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("moe_grouped: could not allocate its buffers")
    if rc != 0:
        raise ValueError(f"moe_grouped: a GEMM refused its weights (code {rc})")
    return out


def grouped_experts_torch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """The reference: the same grouping in torch. gate_up: [num_local, 2 * inter, hidden]
    (gate rows first), down: [num_local, hidden, inter]."""
    num_local = gate_up.shape[0]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1) - first_expert
    local = (flat_ids >= 0) & (flat_ids < num_local)
    pairs = local.nonzero().squeeze(1)  # indices into the [T * K] pairs
    if pairs.numel() == 0:
        return out
    order = torch.sort(flat_ids[pairs], stable=True).indices
    pairs = pairs[order]
    experts = flat_ids[pairs]
    counts = torch.bincount(experts, minlength=num_local).tolist()
    k = topk_ids.shape[1]
    tokens = pairs // k
    weights = topk_weights.reshape(-1)[pairs].to(x.dtype)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start : start + n]
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tok, y * weights[start : start + n, None])
        start += n
    return out
