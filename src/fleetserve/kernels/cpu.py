"""The C kernels for the CPU: their signatures (`load()`) and torch wrappers.

kernels/library.py builds and opens the library (without importing torch). The source
ships with the package; the first use compiles it with the system C compiler into
``$FLEETSERVE_CACHE/kernels`` (default ``~/.cache/fleetserve/kernels``), keyed by a
hash of the source, the flags and the CPU, so later starts load it in milliseconds. No
torch headers are involved: tensors are passed as raw pointers through ctypes. When no
compiler is found, or ``FLEETSERVE_CPU_KERNELS=0``, ``load()`` returns None and callers
use their plain-torch path.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from typing import Any

import torch

from fleetserve.kernels import huge_pages, library

# The library's build and cache (torch-free), as they were here before.
from fleetserve.kernels.library import _build as _build
from fleetserve.kernels.library import _cache_dir as _cache_dir
from fleetserve.kernels.library import _cpu_signature as _cpu_signature


@cache
def load() -> ctypes.CDLL | None:
    """The kernel library with its functions' signatures set, or None when it cannot be
    used here (kernels/library.py builds and opens it, without torch)."""
    lib = library.open_library()
    if lib is None:
        return None
    p, i64p = ctypes.c_void_p, ctypes.c_void_p
    lib.paged_attention.argtypes = [
        p, ctypes.c_int64, p, p, p,  # q, its row stride, k_cache, v_cache, out
        ctypes.c_int, i64p, i64p, i64p, i64p, ctypes.c_int64,  # seqs, starts, lens, tables
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # heads, kv heads, hd, bs
        ctypes.c_float, ctypes.c_int, ctypes.c_float,  # scale, window, cap
        ctypes.c_int, ctypes.c_int,  # kv_bf16, threads
    ]  # fmt: skip
    lib.paged_attention.restype = ctypes.c_int
    i64, i32, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.rms_norm.argtypes = [p, i64, p, p, p, i64, i64, f32, i32]
    lib.rms_norm_heads.argtypes = [p, i64, i32, p, p, i64, i32, f32, i32]
    lib.silu_mul.argtypes = [p, i64, p, i64, i64, i32]
    lib.gelu_tanh_mul.argtypes = [p, i64, p, i64, i64, i32]
    lib.rotary.argtypes = [p, i64, i32, p, i64, i32, i32, p, p, p, i64, i32]
    lib.cache_write.argtypes = [p, i64, p, i64, p, p, p, p, i64, i32, i32, i32, i32, i32]
    lib.gemm_pack_weight.argtypes = [p, i64, i64, p, i32]
    for fn in (
        lib.rms_norm, lib.rms_norm_heads, lib.silu_mul, lib.gelu_tanh_mul, lib.rotary,
        lib.cache_write, lib.gemm_pack_weight,
    ):  # fmt: skip
        fn.restype = None
    lib.gemm_packed.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32]
    lib.gemm_packed.restype = ctypes.c_int
    lib.gemm_panel_width.argtypes = []
    lib.gemm_panel_width.restype = ctypes.c_int
    lib.attention_amx_set.argtypes = [i32]
    lib.attention_amx_set.restype = None
    lib.attention_amx_active.argtypes = []
    lib.attention_amx_active.restype = i32
    lib.attention_tiles_kind.argtypes = []
    lib.attention_tiles_kind.restype = i32
    return lib


def _lib() -> ctypes.CDLL:
    lib = load()
    assert lib is not None, "CPU kernels not available"
    return lib


def _rows(name: str, t: torch.Tensor) -> int:
    """Row stride of a 2-D float32 CPU tensor whose rows are contiguous."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a float32 CPU matrix with contiguous rows")
    return t.stride(0)


def _check_heads(**tensors: torch.Tensor) -> None:
    """[tokens, heads, head_dim] float32 tensors whose heads are contiguous within each
    token (tokens may be strided: slices of a fused qkv projection)."""
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} must be float32 with each token's heads contiguous")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ([rows, n]); with ``residual`` ([rows, n],
    contiguous), first ``residual += x`` in place and normalise the sum instead."""
    rows, n = x.shape
    x_stride = _rows("x", x)
    if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape):
        raise ValueError("residual must be contiguous and shaped like x")
    out = torch.empty(rows, n)
    _lib().rms_norm(
        x.data_ptr(), x_stride, None if residual is None else residual.data_ptr(),
        out.data_ptr(), weight.data_ptr(), rows, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of ``x`` ([tokens, heads, head_dim], each token's heads
    contiguous, tokens may be strided: q or k of the fused qkv output) into a new
    contiguous tensor of the same shape (Qwen3's q/k norm)."""
    tokens, heads, head_dim = x.shape
    _check_heads(x=x)
    out = torch.empty(tokens, heads, head_dim)
    _lib().rms_norm_heads(
        x.data_ptr(), x.stride(0), heads, out.data_ptr(), weight.data_ptr(), tokens, head_dim,
        eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where each row of ``gate_up`` is [gate | up]."""
    return _gated(gate_up, _lib().silu_mul)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU), each row of ``gate_up`` [gate | up]."""
    return _gated(gate_up, _lib().gelu_tanh_mul)


def _gated(gate_up: torch.Tensor, fn: Any) -> torch.Tensor:
    rows, two_n = gate_up.shape
    stride = _rows("gate_up", gate_up)
    out = torch.empty(rows, two_n // 2)
    fn(gate_up.data_ptr(), stride, out.data_ptr(), rows, two_n // 2, torch.get_num_threads())
    return out


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:  # fmt: skip
    """Rotate q ([tokens, heads, head_dim]) and k ([tokens, kv_heads, head_dim]) in place;
    each token's heads must be contiguous, tokens may be strided. cos/sin:
    [max_position, head_dim / 2] contiguous; positions int64."""
    tokens, heads, head_dim = q.shape
    _check_heads(q=q, k=k)
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("positions must be a contiguous int64 tensor")
    _lib().rotary(
        q.data_ptr(), q.stride(0), heads, k.data_ptr(), k.stride(0), k.shape[1], head_dim,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, torch.get_num_threads(),
    )  # fmt: skip


def cache_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
) -> None:  # fmt: skip
    """Write this step's keys and values into their cache slots, in the kernel layout
    (see `paged_attention`): ``k_cache[slot_blocks, :, :, slot_offsets] = k`` and
    ``v_cache[slot_blocks, :, slot_offsets] = v``. k, v: [tokens, kv_heads, head_dim]
    with each token's heads contiguous; a bf16 cache gets them rounded to nearest even."""
    tokens, kv_heads, head_dim = k.shape
    _check_heads(k=k, v=v)
    block_size = _check_caches(k_cache, v_cache, kv_heads, head_dim)
    for name, t in (("slot_blocks", slot_blocks), ("slot_offsets", slot_offsets)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.numel() != tokens:
            raise ValueError(f"{name} must be a contiguous int64 tensor, one entry per token")
    _lib().cache_write(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(), tokens,
        kv_heads, head_dim, block_size, int(k_cache.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )  # fmt: skip


# What the kernels' caches may hold: bf16 is widened to float32 as it is read.
KV_DTYPES = (torch.float32, torch.bfloat16)


def kv_cache_shapes(
    num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the (k, v) caches the kernels read: keys d-major within a block."""
    return (
        (num_blocks, num_kv_heads, head_dim, block_size),
        (num_blocks, num_kv_heads, block_size, head_dim),
    )


def _check_caches(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int
) -> int:
    """The block size of a (k, v) cache pair in the kernel layout; ValueError otherwise."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in KV_DTYPES or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 or bfloat16 CPU tensor")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have one dtype")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    num_blocks, _, block_size, _ = v_cache.shape
    want_k, want_v = kv_cache_shapes(num_blocks, kv_heads, block_size, head_dim)
    if tuple(k_cache.shape) != want_k or tuple(v_cache.shape) != want_v:
        raise ValueError(
            f"k_cache/v_cache must be shaped {want_k} / {want_v} (keys d-major), got "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    return block_size


def set_attention_amx(mode: bool | None) -> None:
    """Whether attention over a bf16 cache runs with bf16 products: query tiles of several
    rows (kernels/attention_amx.c: AMX-BF16 tile products, or `vdpbf16ps` register blocks
    on CPUs with AVX512-BF16 but no AMX) and decode / verification rows
    (kernels/paged_decode_bf16.h, `vdpbf16ps`): True (where the CPU allows), False (the
    float32 FMA loops), None (back to the environment: FLEETSERVE_ATTENTION_AMX=0 turns
    all off, FLEETSERVE_AMX=0 only AMX). For tests and A/B runs; process-wide."""
    _lib().attention_amx_set(-1 if mode is None else int(mode))


def attention_amx_active() -> bool:
    """Whether such tiles run on AMX in this process now (False without the library)."""
    lib = load()
    return lib is not None and bool(lib.attention_amx_active())


def attention_tiles() -> str | None:
    """Which kernel such tiles run in this process now: "amx", "avx512_bf16", or None (the
    float32 FMA loop: switched off, no AVX512-BF16, or no library)."""
    lib = load()
    kind = 0 if lib is None else int(lib.attention_tiles_kind())
    return {2: "amx", 1: "avx512_bf16"}.get(kind)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attend the given sequences' query rows of ``q`` into the same rows of ``out``.

    ``sliding_window`` W: a query at position p sees keys p - W + 1 .. p only (blocks
    wholly before them are never read); ``softcap`` c: scores become c * tanh(s / c).

    q/out: [num_tokens, num_heads, head_dim] (q's tokens may be strided, e.g. a slice of
    the fused qkv output, each token's heads contiguous); k_cache: [num_blocks,
    num_kv_heads, head_dim, block_size] (d-major within a block); v_cache: [num_blocks,
    num_kv_heads, block_size, head_dim] (`kv_cache_shapes`); q_starts/q_lens/seq_lens:
    int64 [num_seqs]; block_tables: int64 [num_seqs, max_blocks]. On the CPU, contiguous
    but for q; q/out float32, the caches float32 or bfloat16 (both the same).
    """
    lib = _lib()
    if q.device.type != "cpu" or q.dim() != 3:
        raise ValueError("q must be a [tokens, heads, head_dim] float32 CPU tensor")
    _check_heads(q=q)
    if (
        out.dtype != torch.float32
        or not out.is_contiguous()
        or out.device.type != "cpu"
        or out.shape != q.shape
    ):
        raise ValueError("out must be a contiguous float32 CPU tensor shaped like q")
    if _check_caches(k_cache, v_cache, k_cache.shape[1], q.shape[2]) != block_size:
        raise ValueError(f"block_size {block_size} does not match the caches")
    for name, t in (
        ("q_starts", q_starts),
        ("q_lens", q_lens),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor")
    num_seqs = q_starts.numel()
    if num_seqs == 0:
        return
    rc = lib.paged_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        num_seqs,
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        seq_lens.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        q.shape[1],
        k_cache.shape[1],
        q.shape[2],
        block_size,
        scale,
        sliding_window or 0,
        softcap or 0.0,
        int(k_cache.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("paged_attention: could not allocate its score buffers")


# Tensors on transparent huge pages (kernels/huge_pages.py), used by the weights here.
empty_huge = huge_pages.empty_huge
zeroed_huge = huge_pages.zeroed_huge


def kv_prefault() -> bool:
    """FLEETSERVE_KV_PREFAULT=0 leaves the KV cache's pages to its first writes (the test
    suite sets it: its engines touch a few blocks of caches sized for a server)."""
    return os.environ.get("FLEETSERVE_KV_PREFAULT", "1") != "0"


def gemm_worthwhile() -> bool:
    """Whether gemm.c beats torch's BLAS here: it relies on wide vectors, so an x86 CPU
    without AVX2 keeps the BLAS (gemm.c is correct there, only slow)."""
    if platform.machine() not in ("x86_64", "AMD64", "i686"):
        return True
    return " avx2" in _cpu_signature()


class PackedWeight:
    """A linear layer's weight ([out_features, in_features]) in the GEMM kernel's
    panel layout (see gemm.c); ``data`` owns the memory."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError("weight must be a float32 CPU matrix")
        lib = _lib()
        w = weight.detach().contiguous()
        self.out_features, self.in_features = w.shape
        nr = lib.gemm_panel_width()
        panels = -(-self.out_features // nr)
        self.data = empty_huge(panels * self.in_features * nr)
        lib.gemm_pack_weight(
            w.data_ptr(), self.out_features, self.in_features, self.data.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip


def packed_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for x [..., in_features] with W packed."""
    k = weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.device.type != "cpu":
        raise ValueError("x must be a float32 CPU tensor")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("bias must be a contiguous float32 tensor")
    m, n = x2.shape[0], weight.out_features
    out = torch.empty(m, n)
    if m:
        rc = _lib().gemm_packed(
            x2.data_ptr(), x2.stride(0), weight.data.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("gemm_packed: could not allocate its row buffer")
    return out.view(*x.shape[:-1], n)
