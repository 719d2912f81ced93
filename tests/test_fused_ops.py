"""The fused C ops (norm, silu*mul, gelu_tanh*mul, rotary, cache write) against the plain-torch layers.

Inputs are slices of wider buffers where the model passes such slices (q/k/v of the
fused qkv projection, gate/up halves), so the strided cases are the ones tested.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.mark.parametrize(("rows", "n"), [(1, 768), (5, 20), (300, 576)])
def test_rms_norm_with_and_without_residual(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n, generator=g)
    wide = torch.randn(rows, n + 7, generator=g) * 3
    x = wide[:, 3 : 3 + n]  # strided rows
    torch.testing.assert_close(cpu_kernels.rms_norm(x, norm.weight, 1e-5), norm(x))

    residual = torch.randn(rows, n, generator=g)
    expect_res = residual + x
    expect = norm(expect_res)
    got = cpu_kernels.rms_norm(x, norm.weight, 1e-5, residual)
    torch.testing.assert_close(residual, expect_res)  # updated in place
    torch.testing.assert_close(got, expect)


@pytest.mark.parametrize(("rows", "n"), [(1, 2048), (3, 13), (200, 96)])
def test_silu_mul(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(("rows", "n", "spread"), [(1, 2048, 4.0), (3, 13, 1.0), (64, 96, 300.0)])
def test_gelu_tanh_mul(rows: int, n: int, spread: float) -> None:
    """Gemma's GeGLU: gates far into both tails too (exp overflows past |g| ~ 10, which
    under -ffast-math gave NaN before the exponent was clamped)."""
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * spread
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_kernels.gelu_tanh_mul(gate_up)
    assert torch.isfinite(got).all()
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * spread)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 4, 64), (3, 1, 10), (8, 8, 128)])
def test_rotary_in_place_on_qkv_slices(heads: int, kv_heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(heads)
    rope = RotaryEmbedding(head_dim, 600, 10000.0, None)
    tokens = 37
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g)
    positions = torch.randint(0, 600, (tokens,), generator=g)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    expect_q, expect_k = rope(positions, q.clone(), k.clone())  # torch path
    v_before = qkv[:, q_size + kv_size :].clone()
    cpu_kernels.rotary(q, k, positions, rope.cos, rope.sin)
    torch.testing.assert_close(q, expect_q)
    torch.testing.assert_close(k, expect_k)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)  # v untouched


def test_cache_write_matches_index_put() -> None:
    g = torch.Generator().manual_seed(0)
    blocks, kv_heads, bs, hd, tokens = 9, 2, 4, 8, 11
    kv = torch.randn(tokens, 2 * kv_heads * hd, generator=g)
    k = kv[:, : kv_heads * hd].view(tokens, kv_heads, hd)
    v = kv[:, kv_heads * hd :].view(tokens, kv_heads, hd)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    slot_blocks, slot_offsets = slots // bs, slots % bs
    k_shape, v_shape = cpu_kernels.kv_cache_shapes(blocks, kv_heads, bs, hd)
    assert k_shape == (blocks, kv_heads, hd, bs) and v_shape == (blocks, kv_heads, bs, hd)
    k_cache, v_cache = torch.zeros(k_shape), torch.zeros(v_shape)
    cpu_kernels.cache_write(k, v, k_cache, v_cache, slot_blocks, slot_offsets)
    # Keys land d-major within their block, values token-major.
    k_ref, v_ref = torch.zeros(v_shape), torch.zeros(v_shape)
    k_ref[slot_blocks, :, slot_offsets] = k
    v_ref[slot_blocks, :, slot_offsets] = v
    assert torch.equal(k_cache, k_ref.transpose(2, 3))
    assert torch.equal(v_cache, v_ref)
    with pytest.raises(ValueError, match="keys d-major"):
        cpu_kernels.cache_write(k, v, v_cache.clone(), v_cache, slot_blocks, slot_offsets)
    with pytest.raises(ValueError, match="slot_offsets must be"):
        cpu_kernels.cache_write(k, v, k_cache, v_cache, slot_blocks, slot_offsets[:-1])


def test_cache_write_to_bf16_rounds_as_torch() -> None:
    """A bf16 cache gets each value rounded to nearest even, exactly as torch's
    `.to(torch.bfloat16)` (ties, tiny and huge values, infinities; NaN stays NaN)."""
    g = torch.Generator().manual_seed(1)
    blocks, kv_heads, bs, hd, tokens = 5, 2, 4, 16, 9
    kv = torch.randn(tokens, 2 * kv_heads * hd, generator=g) * 3
    # Exact ties (odd and even lower halves), subnormals, overflow to inf, inf, NaN.
    specials = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1e-40, -3e-39, 3.4e38, float("inf"),
         float("-inf"), float("nan"), 0.0, -0.0, 65504.0, 1e-3, 7.0, -7.5, 2**-126],
    )  # fmt: skip
    kv[0, : specials.numel()] = specials
    kv[3, kv_heads * hd : kv_heads * hd + specials.numel()] = specials
    k = kv[:, : kv_heads * hd].view(tokens, kv_heads, hd)
    v = kv[:, kv_heads * hd :].view(tokens, kv_heads, hd)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    slot_blocks, slot_offsets = slots // bs, slots % bs
    k_shape, v_shape = cpu_kernels.kv_cache_shapes(blocks, kv_heads, bs, hd)
    k_cache = torch.zeros(k_shape, dtype=torch.bfloat16)
    v_cache = torch.zeros(v_shape, dtype=torch.bfloat16)
    cpu_kernels.cache_write(k, v, k_cache, v_cache, slot_blocks, slot_offsets)
    k_ref = torch.zeros(v_shape, dtype=torch.bfloat16)
    v_ref = torch.zeros(v_shape, dtype=torch.bfloat16)
    k_ref[slot_blocks, :, slot_offsets] = k.bfloat16()
    v_ref[slot_blocks, :, slot_offsets] = v.bfloat16()
    # Compared as bits (-0.0 is not 0.0), but for NaN, whose payload torch does not fix.
    for got, want in ((k_cache, k_ref.transpose(2, 3).contiguous()), (v_cache, v_ref)):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan) and int(nan.sum()) == 1
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_bad_layouts_are_refused() -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="x must be"):
        cpu_kernels.rms_norm(torch.ones(8, 4).t(), w, 1e-5)
    with pytest.raises(ValueError, match="x must be"):
        cpu_kernels.rms_norm(torch.ones(4, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        cpu_kernels.rms_norm(torch.ones(4, 8), w, 1e-5, torch.ones(8, 4).t())
    q = torch.ones(3, 2, 8).transpose(1, 2).contiguous().transpose(1, 2)  # heads strided
    with pytest.raises(ValueError, match="q must be"):
        cpu_kernels.rotary(q, torch.ones(3, 1, 8), torch.zeros(3, dtype=torch.long), w, w)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    # single rows, tails in rows and in columns (n not a multiple of the panel width),
    # more rows than one packed block, a vocab-sized output
    [(1, 64, 16), (5, 70, 33), (13, 1280, 768), (130, 96, 200), (3, 32000, 64)],
)
def test_packed_linear_matches_f_linear(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    wide = torch.randn(m, k + 5, generator=g)
    x = wide[:, 2 : 2 + k]  # strided rows
    packed = cpu_kernels.PackedWeight(w)
    torch.testing.assert_close(
        cpu_kernels.packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(
        cpu_kernels.packed_linear(x, packed), F.linear(x, w), rtol=1e-4, atol=1e-4
    )
    assert cpu_kernels.packed_linear(x[:0], packed).shape == (0, n)
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.packed_linear(torch.ones(2, k + 1), packed)


def test_packed_linear_layer_drops_the_row_major_weight() -> None:
    from fleetserve.layers.linear import Linear

    layer = Linear(24, 40, bias=True)
    x = torch.randn(6, 24)
    expect = layer(x)
    layer.pack_for_cpu()
    assert layer.weight.numel() == 0 and layer.packed is not None
    torch.testing.assert_close(layer(x), expect, rtol=1e-5, atol=1e-5)


def test_empty_huge_is_a_plain_tensor() -> None:
    t = cpu_kernels.empty_huge(3, 1 << 20)  # 12 MiB: has a 2 MiB-aligned interior
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    small = cpu_kernels.empty_huge(5, dtype=torch.float64)  # too small to advise: fine too
    assert small.shape == (5,) and small.dtype == torch.float64


def test_zeroed_huge_is_zero_with_or_without_prefault() -> None:
    import gc

    for prefault in (True, False):
        # Memory freed just before is what a recycling allocator would hand back.
        junk = torch.full((3, 1 << 20), 7.0)
        del junk
        gc.collect()
        t = cpu_kernels.zeroed_huge(3, 1 << 20, dtype=torch.float32, prefault=prefault)
        assert t.shape == (3, 1 << 20) and t.is_contiguous() and float(t.abs().sum()) == 0.0
        t[1, 5] = 3.0  # writable, and outlives the function's own reference to its mapping
        assert float(t.sum()) == 3.0
        small = cpu_kernels.zeroed_huge(2, 3, dtype=torch.bfloat16, prefault=prefault)
        assert small.dtype == torch.bfloat16 and float(small.float().abs().sum()) == 0.0
