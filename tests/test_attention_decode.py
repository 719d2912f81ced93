"""Decode rows (one query row per sequence) of the C paged-attention kernel, which take a
one-pass path on AVX-512 with 16-key blocks (kernels/paged_decode.h), against dense
attention in float64: sliding windows whose first key falls inside a block, score
softcaps, 1-8 query heads per kv head, head sizes 32-128 (bf16 pairs and not), caches in
float32 and bf16, contexts from one key to many blocks (with a partial last block).

Over a bf16 cache, head sizes that are multiples of 32 run on bf16 products where the CPU
has AVX512-BF16 (kernels/paged_decode_bf16.h, `vdpbf16ps`): q rounded to bf16 once per
row and P rounded to bf16 per block, so the reference takes the same bf16 q and the
tolerance is P's rounding (as tests/test_attention_amx.py's tiles); with the switch off
(`set_attention_amx(False)`) the float32 FMA loop keeps float32 q and the tight tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from fleetserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def dense_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """q: [H, hd]; keys/values: [L, KVH, hd] in order; the query is at position L - 1."""
    heads, n = q.shape[0], keys.shape[0]
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).double()  # [H, L, hd]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).double()
    s = torch.einsum("hd,hld->hl", q.double(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if window > 0:
        s[:, : max(0, n - window)] = float("-inf")
    return torch.einsum("hl,hld->hd", s.softmax(-1), v).float()


# kv cache dtype, bf16 products switched on (where the CPU has them)
KV = {
    "float32": (torch.float32, True),
    "bf16_products": (torch.bfloat16, True),
    "bf16_fma": (torch.bfloat16, False),
}


@pytest.fixture(params=sorted(KV))
def kv(request: pytest.FixtureRequest) -> Iterator[tuple[torch.dtype, bool]]:
    """(cache dtype, whether bf16 products run for head sizes that are multiples of 32);
    the switch back to the environment's choice after."""
    dtype, products = KV[str(request.param)]
    cpu_kernels.set_attention_amx(products)
    try:
        on = dtype == torch.bfloat16 and products and cpu_kernels.attention_tiles() is not None
        yield dtype, on
    finally:
        cpu_kernels.set_attention_amx(None)


def assert_matches(
    out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    scale: float, window: int, softcap: float, products: bool,
) -> None:  # fmt: skip
    """One row against float64 attention: on bf16 products (products and head_dim a
    multiple of 32) against bf16 q, P's rounding allowed (measured: at most 3.5e-3, mean
    5e-4 over these tests' rows); else against float32 q, tightly."""
    if products and q.shape[-1] % 32 == 0:
        want = dense_decode(q.bfloat16().float(), keys, values, scale, window, softcap)
        torch.testing.assert_close(out, want, atol=4e-3, rtol=1e-2)
        assert (out - want).abs().mean() < 1e-3
    else:
        want = dense_decode(q, keys, values, scale, window, softcap)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(12, 4, 64), (16, 4, 128), (12, 2, 32), (8, 1, 48), (8, 8, 64), (4, 2, 96)],
)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (21, 0.0), (0, 5.0), (37, 3.0)])
def test_decode_rows_match_dense_attention(
    heads: int, kv_heads: int, head_dim: int, kv: tuple[torch.dtype, bool], window: int,
    softcap: float,
) -> None:  # fmt: skip
    kv_dtype, products = kv
    bs = 16
    g = torch.Generator().manual_seed(heads * 100 + head_dim + window)
    seq_lens = [1, 5, 16, 17, 40, 77, 130, 300]
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    k_rows = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=g).to(kv_dtype)
    k_cache = k_rows.transpose(2, 3).contiguous()
    v_cache = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=g).to(kv_dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    width = max(len(t) for t in tables)
    q = 2 * torch.randn(len(seq_lens), heads, head_dim, generator=g)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    cpu_kernels.paged_attention(
        q, k_cache, v_cache, out,
        torch.arange(len(seq_lens)), torch.ones(len(seq_lens), dtype=torch.int64),
        torch.tensor(seq_lens), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        bs, scale, sliding_window=window or None, softcap=softcap or None,
    )  # fmt: skip
    for i, (n, table) in enumerate(zip(seq_lens, tables, strict=True)):
        keys = k_rows[table].float().transpose(1, 2).reshape(-1, kv_heads, head_dim)[:n]
        values = v_cache[table].float().transpose(1, 2).reshape(-1, kv_heads, head_dim)[:n]
        assert_matches(out[i], q[i], keys, values, scale, window, softcap, products)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # bf16 pairs with one row pass (64) and several (128: 6 rows a pass), no pairs (48),
    # SmolLM2's 3 query heads per kv head, 8 per kv head
    [(12, 4, 64), (16, 4, 128), (8, 1, 48), (9, 3, 64), (8, 1, 64)],
)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (21, 3.0), (5, 0.0), (40, 0.0)])
def test_verification_rows_equal_plain_decodes(
    heads: int, kv_heads: int, head_dim: int, kv: tuple[torch.dtype, bool], window: int,
    softcap: float,
) -> None:  # fmt: skip
    """A query of k + 1 rows (speculative verification) gives each row the bits plain
    decoding gets at that position: one call with queries of 2-16 rows after cached
    contexts, against one decode call per row over the same cache (the verification row r
    sees the context and rows 0..r, as the decode at that position does). The rows walk
    the blocks together (paged_verify.h): contexts end inside a block and on its edge, the
    rows spill into one to two more blocks, windows shorter than the query start in
    different blocks for different rows."""
    kv_dtype, products = kv
    bs = 16
    g = torch.Generator().manual_seed(7 + window + head_dim + heads)
    # (query rows, cached context)
    shapes = [(5, 11), (8, 300), (2, 40), (16, 77), (3, 0), (16, 0), (9, 32), (12, 31)]
    shapes += [(r, 13 * r + 7) for r in (4, 6, 7, 10, 11, 13, 14, 15)]
    num_blocks = sum(-(-(q + c) // bs) for q, c in shapes) + 3
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, bs, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=g).to(kv_dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-(q + c) // bs))] for q, c in shapes]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = 2 * torch.randn(sum(s[0] for s in shapes), heads, head_dim, generator=g)
    starts = torch.tensor([0] + [s[0] for s in shapes]).cumsum(0)[:-1]
    scale = 1 / math.sqrt(head_dim)
    kw = {"sliding_window": window or None, "softcap": softcap or None}
    verified = torch.full_like(q, float("nan"))
    cpu_kernels.paged_attention(
        q, k_cache, v_cache, verified, starts, torch.tensor([s[0] for s in shapes]),
        torch.tensor([sum(s) for s in shapes]), padded, bs, scale, **kw,
    )  # fmt: skip
    for i, (q_len, ctx) in enumerate(shapes):
        for r in range(q_len):
            row = int(starts[i]) + r
            one = torch.full_like(q[row : row + 1], float("nan"))
            cpu_kernels.paged_attention(
                q[row : row + 1], k_cache, v_cache, one, torch.tensor([0]),
                torch.tensor([1]), torch.tensor([ctx + r + 1]), padded[i : i + 1], bs, scale,
                **kw,
            )  # fmt: skip
            assert torch.equal(verified[row], one[0]), (q_len, ctx, r)
        # and the rows are right, not only equal to decodes: dense attention in float64
        keys = k_cache[tables[i]].float().transpose(2, 3).transpose(1, 2)
        values = v_cache[tables[i]].float().transpose(1, 2)
        keys = keys.reshape(-1, kv_heads, head_dim)
        values = values.reshape(-1, kv_heads, head_dim)
        for r in (0, q_len - 1):
            n = ctx + r + 1
            row = int(starts[i]) + r
            assert_matches(verified[row], q[row], keys[:n], values[:n], scale, window, softcap,
                           products)  # fmt: skip


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (8, 1, 48)])
def test_cache_slots_past_the_last_key_are_never_read(
    heads: int, kv_heads: int, head_dim: int, kv: tuple[torch.dtype, bool]
) -> None:
    """A last block's slots past the sequence's keys hold whatever was there (a freed
    block's old rows, never-written memory), NaN included: decode and verification rows
    give the same bits over a cache with NaN there as over one without (the bf16 products
    pair an odd last value row with zeros: 0 * NaN would be NaN)."""
    kv_dtype, _ = kv
    bs = 16
    g = torch.Generator().manual_seed(head_dim)
    # (query rows, cached context): tails of 1, 5, 15 and 16 keys, odd and even
    shapes = [(1, 0), (1, 4), (1, 30), (1, 47), (3, 14), (4, 33), (1, 15)]
    num_blocks = sum(-(-(q + c) // bs) for q, c in shapes)
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, bs, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=g).to(kv_dtype)
    tables, b = [], 0
    for q_len, ctx in shapes:
        n = -(-(q_len + ctx) // bs)
        tables.append(list(range(b, b + n)))
        b += n
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(sum(s[0] for s in shapes), heads, head_dim, generator=g)
    starts = torch.tensor([0] + [s[0] for s in shapes]).cumsum(0)[:-1]
    q_lens = torch.tensor([s[0] for s in shapes])
    seq_lens = torch.tensor([sum(s) for s in shapes])

    def attend() -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        cpu_kernels.paged_attention(
            q, k_cache, v_cache, out, starts, q_lens, seq_lens, padded, bs, head_dim**-0.5
        )
        return out

    clean = attend()
    for table, n in zip(tables, seq_lens.tolist(), strict=True):
        if n % bs:
            k_cache[table[-1], :, :, n % bs :] = float("nan")
            v_cache[table[-1], :, n % bs :, :] = float("nan")
    dirty = attend()
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, dirty)
