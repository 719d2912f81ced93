"""GGUF-quantized weights kept in their block format, multiplied by quant_gemm.c.

A `QuantWeight` is one matrix [out_features, in_features] stored as the GGUF file stores
it: one row of blocks per output feature. `quant_linear` is ``F.linear`` on it and
`quant_embedding` an embedding lookup that decodes only the rows asked for. The C library
is the one `kernels.cpu` builds (same cache, same fallbacks).
"""

from __future__ import annotations

import ctypes
import enum
from functools import cache

import numpy as np
import torch

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels import library


class QType(enum.IntEnum):
    """GGML type ids of the block formats quant_gemm.c multiplies."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


# qtype -> (elements per block, bytes per block), as in ggml
BLOCK_SHAPES = {
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q5_0: (32, 22),
    QType.Q5_1: (32, 24),
    QType.Q8_0: (32, 34),
    QType.Q4_K: (256, 144),
    QType.Q5_K: (256, 176),
    QType.Q6_K: (256, 210),
}


def supported(qtype: int) -> bool:
    return qtype in BLOCK_SHAPES


# Formats with an integer-dot-product kernel (quant_dot.h): int8 activations at decode.
DOT_QTYPES = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0)
# quant_dot.h's QDOT: the storage format id of a weight in the dot layout is its GGML
# type id plus this flag.
_QDOT = 0x100
# quant_dot.h's QDOT_AMX: a dot-layout Q4 / Q5 weight whose buffer also holds its quants
# unpacked to bytes (read by AMX-INT8 on steps of >= 15 rows; FLEETSERVE_AMX_COPY=1).
_QDOT_AMX = 0x200


@cache
def _lib() -> ctypes.CDLL:
    lib = cpu_kernels.load()
    if lib is None:
        raise RuntimeError("quantized weights need the CPU kernels (a C compiler)")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_gemm.argtypes = [i32, p, i64, p, i64, p, p, i64, i64, i64, i64, i32]
    lib.quant_gemm.restype = i32
    lib.quant_dequantize_rows.argtypes = [i32, p, i64, p, i64, i64, p, i32]
    lib.quant_dequantize_rows.restype = None
    lib.quant_panel_layout.argtypes = [i32]
    lib.quant_panel_layout.restype = i32
    lib.quant_dot_amx_copy_bytes.argtypes = [i32, i64, i64]
    lib.quant_dot_amx_copy_bytes.restype = i64
    lib.quant_dot_amx_copy.argtypes = [i32, p, i64, i64, p, i32]
    lib.quant_dot_amx_copy.restype = None
    lib.quant_repack.argtypes = [i32, p, i64, i64, p, i32]
    lib.quant_repack.restype = None
    lib.quant_dot_repack.argtypes = [i32, p, i64, i64, p, i32]
    lib.quant_dot_repack.restype = None
    lib.quant_dot_quantize_x.argtypes = [p, i64, i64, i64, p]
    lib.quant_dot_quantize_x.restype = None
    lib.quant_dot_kind.argtypes = []
    lib.quant_dot_kind.restype = i32
    return lib


# The SIMD integer-dot kernel of this build ("AVX-512 VNNI", "AVX2" or None): asked
# without torch (the API process's quantization choice); here for the kernels' callers.
int8_dot_kernel = library.int8_dot_kernel


class QuantWeight:
    """One weight matrix in a GGUF block format, owned (copied off the file's memory map
    onto huge pages). ``data``: uint8 [out_features, row_bytes] in GGUF's row order, or
    for Q4_0 / Q4_1 / Q8_0 the same bytes re-interleaved into panels of 16 rows
    (quant_panel.c), [out_features rounded up to 16, row_bytes].

    ``int8_activations``: multiply with x quantized to int8 per block of 32 and integer
    dot products (W8A8 for Q8_0; quant_dot.h), at every row count, the weights in that
    kernel's own panel layout. Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 only."""

    def __init__(
        self,
        qtype: int,
        data: np.ndarray | torch.Tensor,
        in_features: int,
        int8_activations: bool = False,
    ) -> None:
        if not supported(qtype):
            raise ValueError(f"qtype {qtype} is not one of {[q.name for q in QType]}")
        if int8_activations and qtype not in DOT_QTYPES:
            raise ValueError(
                f"int8_activations needs one of {[q.name for q in DOT_QTYPES]}, got "
                f"{QType(qtype).name}"
            )
        self.qtype = QType(qtype)
        self.int8_activations = int8_activations
        block, nbytes = BLOCK_SHAPES[self.qtype]
        if in_features % block:
            raise ValueError(
                f"in_features={in_features} is not a multiple of {self.qtype.name}'s "
                f"block of {block}"
            )
        self.in_features = in_features
        self.row_bytes = in_features // block * nbytes
        shape = tuple(data.shape)
        if (
            data.dtype not in (np.uint8, torch.uint8)
            or len(shape) != 2
            or shape[1] != self.row_bytes
        ):
            raise ValueError(
                f"data must be uint8 [rows, {self.row_bytes}] for {self.qtype.name} with "
                f"{in_features} inputs, got {data.dtype} {shape}"
            )
        self.out_features = n = shape[0]
        lib = _lib()
        # The id the C kernels know this storage format by.
        self.qtype_id = int(self.qtype) | (_QDOT if int8_activations else 0)
        self.panelled = bool(lib.quant_panel_layout(self.qtype_id))
        # Bytes of the AMX copy (quant_dot.h's QDOT_AMX) kept after the panels; 0: none.
        self.amx_copy_bytes = 0
        if self.panelled:
            src = np.ascontiguousarray(data.numpy() if isinstance(data, torch.Tensor) else data)
            panel_rows = -(-n // 16) * 16
            if int8_activations:
                self.amx_copy_bytes = int(
                    lib.quant_dot_amx_copy_bytes(self.qtype_id, n, in_features)
                )
            extra = -(-self.amx_copy_bytes // self.row_bytes)
            self.data = cpu_kernels.empty_huge(
                panel_rows + extra, self.row_bytes, dtype=torch.uint8
            )
            repack = lib.quant_dot_repack if int8_activations else lib.quant_repack
            repack(
                self.qtype_id, src.ctypes.data, n, self.row_bytes, self.data.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            if self.amx_copy_bytes:
                lib.quant_dot_amx_copy(
                    self.qtype_id, self.data.data_ptr(), n, self.row_bytes,
                    self.data.data_ptr() + panel_rows * self.row_bytes, torch.get_num_threads(),
                )  # fmt: skip
                self.qtype_id |= _QDOT_AMX
        else:
            self.data = cpu_kernels.empty_huge(*shape, dtype=torch.uint8)
            if isinstance(data, np.ndarray):
                # Through numpy: the source may be a read-only view of a GGUF memory map.
                self.data.numpy()[...] = data
            else:
                self.data.copy_(data)

        # Looked up once: quant_linear runs ~120 times per decode step.
        self.gemm = lib.quant_gemm
        self.data_ptr = self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in float32 (for references and the plain-torch path)."""
        ids = torch.arange(self.out_features, dtype=torch.int64)
        return quant_embedding(ids, self)


def quant_linear(
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for x [..., in_features]. With ``out`` (a float32 view
    [rows, out_features] whose rows are contiguous, e.g. columns of a wider output), the
    result is written there and ``out`` returned."""
    k = weight.in_features
    if x.dim() == 2 and out is None and x.is_contiguous() and x.dtype == torch.float32:
        # The decode step's case, once per projection per step: as few torch calls as
        # the checks allow (each costs about a microsecond).
        if x.shape[1] != k:
            raise ValueError(f"x has {x.shape[1]} features, the weight takes {k}")
        x2, dest = x, torch.empty(x.shape[0], weight.out_features)
    else:
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32:
            raise ValueError("x must be a float32 CPU tensor")
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if out is None:
            dest = torch.empty(x2.shape[0], weight.out_features)
        else:
            dest = out
            want = (x2.shape[0], weight.out_features)
            if tuple(dest.shape) != want or dest.stride(1) != 1 or dest.dtype != torch.float32:
                raise ValueError(f"out must be a float32 {list(want)} view with contiguous rows")
    if x2.device.type != "cpu":
        raise ValueError("x must be a float32 CPU tensor")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("bias must be a contiguous float32 tensor")
    m = x2.shape[0]
    if m:
        rc = weight.gemm(
            weight.qtype_id, x2.data_ptr(), x2.stride(0), weight.data_ptr, weight.row_bytes,
            None if bias is None else bias.data_ptr(), dest.data_ptr(), dest.stride(0), m,
            weight.out_features, k, torch.get_num_threads(),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("quant_gemm: could not allocate its buffers")
        if rc != 0:
            raise ValueError(f"quant_gemm does not take {weight.qtype.name} with k={k}")
    if out is not None:
        return dest
    return dest if x.dim() == 2 else dest.view(*x.shape[:-1], weight.out_features)


def quant_embedding(ids: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """Rows ``ids`` of the matrix in float32: [*ids.shape, in_features]."""
    # Each torch call skipped where it would change nothing: this runs every step, right
    # after the step's weights have gone through the caches (a call costs ~10x then).
    flat = ids if ids.dim() == 1 else ids.reshape(-1)
    if flat.dtype != torch.int64:
        flat = flat.to(torch.int64)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = weight.out_features
    # A decode step's few ids checked as Python ints (two numpy reductions cost ~0.1 ms
    # right after a step's weights went through the caches); many ids by numpy's min/max
    # (a few us against ~30 for two torch reductions).
    view = flat.numpy()
    if flat.numel() <= 64:
        ids_list = view.tolist()
        bad = bool(ids_list) and (min(ids_list) < 0 or max(ids_list) >= n)
    else:
        bad = int(view.min()) < 0 or int(view.max()) >= n
    if bad:
        raise IndexError(f"ids must be in [0, {n})")
    out = torch.empty(flat.numel(), weight.in_features)
    if flat.numel():
        _lib().quant_dequantize_rows(
            weight.qtype_id, weight.data.data_ptr(), weight.row_bytes, flat.data_ptr(),
            flat.numel(), weight.in_features, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return out if ids.dim() == 1 else out.view(*ids.shape, weight.in_features)


_XBLOCK = np.dtype(
    [("q", "i1", 32), ("d", "<f4"), ("ds", "<f4"), ("s", "<i4"), ("o", "<i4", 3), ("pad", "<i4", 2)]
)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x ([m, k], k a multiple of 32) as the integer kernels see them: int8
    ``q`` [m, k] and float32 scales ``d`` [m, k / 32], x ~= d * q per block (for tests and
    references; the GEMM quantizes its input itself)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % 32:
        raise ValueError("x must be a float32 [rows, k] matrix with k a multiple of 32")
    x = x.contiguous()
    m, k = x.shape
    # qdot_xblock (quant_dot.h): int8 q[32], float d, ds, int32 s, o8, o16, o128, pad[2]
    blocks = np.zeros((m * (k // 32),), dtype=_XBLOCK)
    if m:
        _lib().quant_dot_quantize_x(x.data_ptr(), k, m, k, blocks.ctypes.data)
    q = torch.from_numpy(blocks["q"].reshape(m, k).copy())
    d = torch.from_numpy(blocks["d"].reshape(m, k // 32).copy())
    return q, d
