"""The C paged-attention kernel against dense causal attention computed in plain torch.

Random caches and block tables (blocks scattered on purpose), query heads sharing kv
heads in several ratios, head sizes that are and are not multiples of the vector width,
block sizes from 1 up, decodes and prefill chunks with cached context in one call; the
caches in float32 and in bf16 (widened as read: the reference gets the same bf16 values).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

from fleetserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def fma_loop() -> Iterator[None]:
    """These tests hold the FMA loop (float32 q) to float32 tolerances: prefill tiles over
    a bf16 cache would take AMX tiles (bf16 q and P, tests/test_attention_amx.py)."""
    cpu_kernels.set_attention_amx(False)
    try:
        yield
    finally:
        cpu_kernels.set_attention_amx(None)


def dense_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int, scale: float
) -> torch.Tensor:
    """q: [q_len, H, hd]; keys/values: [seq_len, KVH, hd] in order. Row j sees 0..ctx+j."""
    q_len, heads, _ = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).double()  # [H, L, hd]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).double()
    scores = torch.einsum("qhd,hld->hql", q.double(), k) * scale
    allowed = torch.arange(keys.shape[0])[None, :] <= ctx + torch.arange(q_len)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hql,hld->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (12, 4, 64, 16),
        (8, 8, 32, 4),
        (6, 1, 12, 3),
        (4, 2, 20, 1),
        (9, 3, 128, 8),
        # Block size 16 (vector path) with groups of 2, 4, 6 and 8 query heads per kv
        # head, head sizes that are and are not multiples of the vector width.
        (16, 4, 128, 16),
        (12, 2, 32, 16),
        (8, 1, 48, 16),
        (6, 3, 20, 16),
        (5, 5, 33, 16),
    ],  # fmt: skip
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dense_attention(
    heads: int, kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    # (query rows, cached context): decodes, then prefill chunks that follow context,
    # including chunks longer than the kernel's query tile and a context of one token.
    shapes = [(1, 5), (1, 40), (1, 1), (1, 77), (7, 9), (33, 50), (17, 1)]
    num_blocks = sum(-(-(q + c) // block_size) for q, c in shapes) + 5
    # Keys are stored d-major within a block (the kernel layout); k_rows is the same
    # cache token-major, for the reference.
    k_rows = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    k_rows = k_rows.to(kv_dtype).float()
    k_cache = k_rows.transpose(2, 3).contiguous().to(kv_dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(kv_dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    total_q = sum(q for q, _ in shapes)
    # q read in place from a slice of a wider row (as from the fused qkv projection).
    wide = torch.randn(total_q, (heads + 2) * head_dim, generator=g)
    q = wide[:, head_dim : (heads + 1) * head_dim].view(total_q, heads, head_dim)
    assert not q.is_contiguous()
    tables, starts, row = [], [], 0
    for q_len, ctx in shapes:
        tables.append([free.pop() for _ in range(-(-(q_len + ctx) // block_size))])
        starts.append(row)
        row += q_len
    width = max(len(t) for t in tables)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        torch.tensor(starts),
        torch.tensor([s[0] for s in shapes]),
        torch.tensor([s[0] + s[1] for s in shapes]),
        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size,
        scale,
    )
    for (q_len, ctx), table, start in zip(shapes, tables, starts, strict=True):
        seq_len = q_len + ctx
        keys = k_rows[table].transpose(1, 2).reshape(-1, kv_heads, head_dim)[:seq_len]
        values = v_cache[table].float().transpose(1, 2).reshape(-1, kv_heads, head_dim)
        values = values[:seq_len]
        want = dense_reference(q[start : start + q_len], keys, values, ctx, scale)
        torch.testing.assert_close(out[start : start + q_len], want, atol=2e-5, rtol=1e-4)


def test_kernel_rows_outside_the_call_are_untouched() -> None:
    q = torch.randn(3, 2, 8)
    k_cache, v_cache = torch.randn(2, 1, 8, 4), torch.randn(2, 1, 4, 8)
    out = torch.zeros_like(q)
    cpu_kernels.paged_attention(
        q, k_cache, v_cache, out, torch.tensor([1]), torch.tensor([1]), torch.tensor([3]),
        torch.tensor([[1]]), 4, 0.5,
    )  # fmt: skip
    assert out[0].abs().sum() == 0 and out[2].abs().sum() == 0
    assert out[1].abs().sum() > 0


def test_kernel_refuses_wrong_dtype_or_layout() -> None:
    q = torch.randn(1, 2, 8)
    k_cache, v_cache = torch.randn(2, 1, 8, 4), torch.randn(2, 1, 4, 8)
    args = (torch.tensor([0]), torch.tensor([1]), torch.tensor([1]), torch.tensor([[0]]), 4, 0.5)
    with pytest.raises(ValueError, match="q must be"):
        cpu_kernels.paged_attention(q.double(), k_cache, v_cache, torch.empty_like(q), *args)
    with pytest.raises(ValueError, match="k_cache must be"):
        cpu_kernels.paged_attention(
            q, torch.randn(2, 1, 4, 8).transpose(2, 3), v_cache, torch.empty_like(q), *args
        )
    # Keys token-major (the torch backend's layout) instead of d-major.
    with pytest.raises(ValueError, match="keys d-major"):
        cpu_kernels.paged_attention(q, v_cache.clone(), v_cache, torch.empty_like(q), *args)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_kernels.paged_attention(
            q, k_cache.bfloat16(), v_cache, torch.empty_like(q), *args
        )  # fmt: skip
    with pytest.raises(ValueError, match="k_cache must be"):
        cpu_kernels.paged_attention(
            q, k_cache.half(), v_cache.half(), torch.empty_like(q), *args
        )  # fmt: skip
    with pytest.raises(ValueError, match="block_size 8 does not match"):
        cpu_kernels.paged_attention(q, k_cache, v_cache, torch.empty_like(q), *args[:4], 8, 0.5)
    with pytest.raises(ValueError, match="block_tables must be"):
        cpu_kernels.paged_attention(
            q, k_cache, v_cache, torch.empty_like(q), *args[:3], torch.tensor([[0.0]]), 4, 0.5
        )


def test_kernel_builds_into_the_cache_folder(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FLEETSERVE_CACHE", str(tmp_path))
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    built = cpu_kernels._build(cc)
    assert built.parent == tmp_path / "kernels" and built.exists()
    assert cpu_kernels._build(cc) == built  # second start: found, not rebuilt
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temp files left
