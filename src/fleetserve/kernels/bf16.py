"""bf16-weight GEMM for any row count (kernels/gemm_bf16.c): AMX-BF16 tiles past 8 rows
on CPUs with AMX (FLEETSERVE_AMX=0 keeps `vdpbf16ps`), `vdpbf16ps` for decode-sized rows
and CPUs without AMX, a portable loop without AVX512-BF16 (chosen when the library is
built for this CPU, AMX asked of Linux at the first wide call). `Linear.to_bf16`
(layers/linear.py) multiplies through it, and the C step runs the same share for its
bf16 weights (decode_step.c's W_BF16), so the two agree bit for bit at every row count."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from fleetserve.kernels import cpu, library


@cache
def _fn() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = cpu._lib()
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gemm_bf16.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32]
    lib.gemm_bf16.restype = ctypes.c_int
    lib.bf16_native.argtypes = []
    lib.bf16_native.restype = ctypes.c_int
    return lib.gemm_bf16


def native() -> bool:
    """Whether the kernel library runs `vdpbf16ps` here."""
    _fn()
    return library.bf16_native()


def gemm_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    threads: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [m, k] float32 (rows may be strided) @ weight.T (+ bias [n] float32), weight
    [n, k] bfloat16 contiguous; x is rounded to bf16, sums are float32. Returns [m, n]
    float32."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be a 2-D float32 tensor with contiguous rows")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError("weight must be a contiguous 2-D bfloat16 tensor")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns, x has {k}")
    if bias is not None and (
        bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != n
    ):
        raise ValueError(f"bias must be a contiguous float32 tensor of {n} values")
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    rc = _fn()(
        x.data_ptr(), x.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
        threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("gemm_bf16: scratch allocation failed")
    return out
