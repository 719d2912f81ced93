"""bf16-weight GEMM for any row count (kernels/gemm_bf16.c): AMX-BF16 tiles on CPUs with
AMX, from one row up (so a row's sums do not depend on its step's other rows),
`vdpbf16ps` on CPUs without AMX or with FLEETSERVE_AMX=0, a portable loop without
AVX512-BF16 (chosen when the library is built for this CPU, AMX asked of Linux at the
first call). `Linear.to_bf16`
(layers/linear.py) multiplies through it, and the C step runs the same share for its
bf16 weights (decode_step.c's W_BF16), so the two agree bit for bit at every row count.

Where AMX multiplies them, weights whose shape tiles (out % 16 == 0, in % 32 == 0) are
laid out once at load as AMX B tiles (`tile_bf16`, kernels/gemm_bf16_tiled.c) and only
kept so: the same sums in the same order as the [n, k] rows, read as contiguous 1 KiB
tiles. Without AMX (Zen 4, or FLEETSERVE_AMX=0) they stay [n, k] rows (`layout_bf16`):
both kernels then run the same `vdpbf16ps` blocks (kernels/bf16_block.h), which take 16
rows as they are but would untile each n-block of tiles first."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from fleetserve.kernels import cpu, library
from fleetserve.kernels.huge_pages import empty_huge


@cache
def _fn() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = cpu._lib()
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gemm_bf16.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32]
    lib.gemm_bf16.restype = ctypes.c_int
    lib.bf16_native.argtypes = []
    lib.bf16_native.restype = ctypes.c_int
    lib.gemm_bf16_tiled.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32]
    lib.gemm_bf16_tiled.restype = ctypes.c_int
    lib.bf16_tiles_pay.argtypes = []
    lib.bf16_tiles_pay.restype = ctypes.c_int
    return lib.gemm_bf16


@dataclass(frozen=True, eq=False)
class TiledBf16:
    """An [out_features, in_features] bf16 weight as AMX B tiles (gemm_bf16_tiled.c):
    tile (b, c) holds rows 16b .. 16b + 15 and inputs 32c .. 32c + 31, pair p of row j
    at p * 32 + j * 2 of its 512 values."""

    data: torch.Tensor  # flat bfloat16, out_features * in_features values
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def numel(self) -> int:
        return self.out_features * self.in_features

    def element_size(self) -> int:
        return 2

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def rows(self) -> torch.Tensor:
        """The [out, in] bf16 rows again (a copy; tests and debugging)."""
        n, k = self.shape
        t = self.data.view(n // 16, k // 32, 16, 16, 2).permute(0, 3, 1, 2, 4)
        return t.reshape(n, k).contiguous()


Bf16Weight = torch.Tensor | TiledBf16


def tileable(n: int, k: int) -> bool:
    """Whether an [n, k] weight takes the tiled layout."""
    return n % 16 == 0 and k % 32 == 0 and n > 0 and k > 0


def tile_bf16(weight: torch.Tensor) -> Bf16Weight:
    """``weight`` [n, k] (any float dtype) rounded to bf16 and laid out as tiles where
    its shape tiles; otherwise contiguous bf16 rows (gemm_bf16.c)."""
    if weight.dim() != 2:
        raise ValueError("weight must be 2-D")
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16)
    # On huge pages like the quantized weights (kernels/huge_pages.py): a decode step
    # streams every weight once, and 4 KiB pages cost a TLB miss and a prefetcher stop
    # every 4 KiB. The same bytes either way.
    if not tileable(n, k):
        return empty_huge(n, k, dtype=torch.bfloat16).copy_(w)
    t = w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
    tiles = empty_huge(n * k, dtype=torch.bfloat16)
    tiles.view(t.shape).copy_(t)
    return TiledBf16(tiles, n, k)


@cache
def tiles_pay() -> bool:
    """Whether AMX multiplies tiles here (the CPU has AMX-BF16, Linux grants it and
    FLEETSERVE_AMX is not 0): then `layout_bf16` tiles."""
    _fn()
    return bool(cpu._lib().bf16_tiles_pay())


def layout_bf16(weight: torch.Tensor) -> Bf16Weight:
    """``weight`` [n, k] rounded to bf16 in the layout this CPU multiplies fastest: AMX B
    tiles where AMX runs them and the shape tiles, else contiguous [n, k] rows (on huge
    pages either way). The sums are the same bits in both (tests/test_bf16_tiled.py)."""
    if tiles_pay():
        return tile_bf16(weight)
    if weight.dim() != 2:
        raise ValueError("weight must be 2-D")
    return empty_huge(*weight.shape, dtype=torch.bfloat16).copy_(weight.detach())


def native() -> bool:
    """Whether the kernel library runs `vdpbf16ps` here."""
    _fn()
    return library.bf16_native()


def gemm_bf16(
    x: torch.Tensor,
    weight: Bf16Weight,
    threads: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [m, k] float32 (rows may be strided) @ weight.T (+ bias [n] float32), weight
    [n, k] bfloat16 contiguous or `TiledBf16`; x is rounded to bf16, sums are float32.
    Returns [m, n] float32."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be a 2-D float32 tensor with contiguous rows")
    tiled = isinstance(weight, TiledBf16)
    if isinstance(weight, torch.Tensor) and (
        weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous()
    ):
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
    fn = _fn()
    if tiled:
        fn = cpu._lib().gemm_bf16_tiled
    rc = fn(
        x.data_ptr(), x.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
        threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("gemm_bf16: scratch allocation failed")
    return out
