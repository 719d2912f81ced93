"""Prefill attention on bf16 tiles (kernels/attention_amx.c: AMX-BF16 tile products, or
`vdpbf16ps` register blocks without AMX) against float64 attention.

Query tiles of several rows over a bf16 cache run as bf16 products: q is rounded to bf16
once per tile and the probabilities P are rounded to bf16 before P V, so the reference
takes the same bf16 q and the tolerance is P's rounding (2^-9 relative per weight) summed
over a row. Covered: query-head groups of 1-8 per kv head, head sizes 32-128, block sizes
16 and 32, rows not a multiple of the 16-row tile, contexts not a multiple of a block,
prefix-cached context (seq_len > q_len), sliding windows, softcap, decode rows in the same
call (bf16 products too where the head size is a multiple of 32: paged_decode_bf16.h), and
the switch back to the FMA loop (which keeps its float32 q).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from fleetserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.fixture
def amx() -> Iterator[bool]:
    """bf16 tiles on for the test (AMX or vdpbf16ps, where the CPU has either): whether
    they run; back to the environment's choice after."""
    cpu_kernels.set_attention_amx(True)
    try:
        yield cpu_kernels.attention_tiles() is not None
    finally:
        cpu_kernels.set_attention_amx(None)


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int, scale: float,
    window: int, softcap: float,
) -> torch.Tensor:  # fmt: skip
    """float64 attention. q: [q_len, H, hd]; keys/values [seq_len, KVH, hd]; row j sits at
    position ctx + j and sees keys (ctx + j - window, ctx + j] (all of 0..ctx+j if 0)."""
    q_len, heads, _ = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).double()
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).double()
    s = torch.einsum("qhd,hld->hql", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = ctx + torch.arange(q_len)[:, None]
    key = torch.arange(keys.shape[0])[None, :]
    allowed = key <= pos
    if window:
        allowed &= key > pos - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hql,hld->qhd", s.softmax(-1), v)


def run_case(
    heads: int, kv_heads: int, head_dim: int, block_size: int, shapes: list[tuple[int, int]],
    window: int = 0, softcap: float = 0.0, seed: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Attend `shapes` ((query rows, cached context) per sequence) in one call over a bf16
    cache with scattered blocks; per sequence (out, float64 reference on bf16 q, reference
    on float32 q)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(q + c) // block_size) for q, c in shapes) + 3
    k_rows = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).bfloat16()
    k_cache = k_rows.transpose(2, 3).contiguous()
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).bfloat16()
    free = torch.randperm(num_blocks, generator=g).tolist()
    total = sum(q for q, _ in shapes)
    wide = torch.randn(total, (heads + 1) * head_dim, generator=g)
    q = wide[:, head_dim:].view(total, heads, head_dim)  # strided rows, as from fused qkv
    tables, starts, row = [], [], 0
    for q_len, ctx in shapes:
        tables.append([free.pop() for _ in range(-(-(q_len + ctx) // block_size))])
        starts.append(row)
        row += q_len
    width = max(len(t) for t in tables)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    cpu_kernels.paged_attention(
        q, k_cache, v_cache, out, torch.tensor(starts), torch.tensor([s[0] for s in shapes]),
        torch.tensor([sum(s) for s in shapes]),
        torch.tensor([t + [0] * (width - len(t)) for t in tables]), block_size, scale,
        sliding_window=window or None, softcap=softcap or None,
    )  # fmt: skip
    results = []
    for (q_len, ctx), table, start in zip(shapes, tables, starts, strict=True):
        n = q_len + ctx
        keys = k_rows[table].float().transpose(1, 2).reshape(-1, kv_heads, head_dim)[:n]
        values = v_cache[table].float().transpose(1, 2).reshape(-1, kv_heads, head_dim)[:n]
        rows = q[start : start + q_len]
        args = (keys, values, ctx, scale, window, softcap)
        want_bf16_q = reference(rows.bfloat16().float(), *args)
        results.append((out[start : start + q_len], want_bf16_q, reference(rows, *args)))
    return results


# (query rows, cached context): prefill chunks from scratch and after cached prefixes,
# rows not a multiple of 16 (tails of 5, 15, 10 and 1 rows: the vdpbf16ps kernel's row
# blocks of 16, 8, 4, 2 and 1 each taken), contexts not a multiple of a block, a decode
# row and items of 2 and 3 rows among them.
SHAPES = [
    (16, 0), (37, 0), (5, 11), (1, 40), (50, 77), (3, 300), (2, 9), (33, 16), (47, 20),
    (26, 3),
]  # fmt: skip


# Items of fewer rows keep the FMA loop (attention_amx.c's AMX_ATTN_MIN_ROWS).
MIN_ROWS = 3
# Queries of at most this many rows (decodes, speculative verification) attend row by row
# (paged_attention.c's VERIFY_ROWS): with bf16 products too (q and P in bf16, as the
# tiles: kernels/paged_decode_bf16.h) for head sizes that are multiples of 32 up to 128
# with 16-key blocks, else the float32 loop.
VERIFY_ROWS = 16


def on_bf16(q_len: int, head_dim: int, block_size: int) -> torch.Tensor:
    """Which of a query's rows run with bf16 products: rows go in items of 16 (the last
    one shorter); queries of up to VERIFY_ROWS rows take the decode rows' kernel, items
    of fewer than MIN_ROWS rows of a longer query the float32 loop."""
    if q_len <= VERIFY_ROWS:
        rows = head_dim % 32 == 0 and head_dim <= 128 and block_size == 16
        return torch.full((q_len,), rows)
    sizes = [min(16, q_len - r // 16 * 16) for r in range(q_len)]
    return torch.tensor([n >= MIN_ROWS for n in sizes])


def check(
    amx: bool, out: torch.Tensor, want_bf16_q: torch.Tensor, want: torch.Tensor,
    block_size: int = 16,
) -> None:  # fmt: skip
    """Rows with bf16 products against the bf16-q reference (P in bf16: each weight off by
    up to 2^-9 relatively, |v| ~ 1); the FMA loop's rows against float32 q, tightly."""
    q_len, _, head_dim = out.shape
    bf16 = on_bf16(q_len, head_dim, block_size) if amx else torch.zeros(q_len, dtype=torch.bool)
    torch.testing.assert_close(out[bf16].double(), want_bf16_q[bf16], atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(out[~bf16], want[~bf16].float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (12, 4, 64, 16),  # the bench Llama's shape
        (8, 8, 32, 16),  # one head per kv head
        (16, 4, 128, 16),  # 4 per kv head, two column passes of P V
        (12, 2, 64, 32),  # 6 per kv head (two score passes), 32-key blocks
        (8, 1, 96, 16),  # 8 per kv head, three 32-dim chunks (odd count)
        (4, 1, 256, 16),  # Gemma 3's head size: four column passes of P V
    ],  # fmt: skip
)
def test_tiles_match_float64_attention(
    amx: bool, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    for out, want_bf16_q, want in run_case(
        heads, kv_heads, head_dim, block_size, SHAPES, seed=heads
    ):
        assert torch.isfinite(out).all()
        check(amx, out, want_bf16_q, want, block_size)


@pytest.mark.parametrize(("window", "softcap"), [(24, 0.0), (0, 5.0), (40, 3.0), (7, 0.0)])
def test_tiles_with_sliding_window_and_softcap(amx: bool, window: int, softcap: float) -> None:
    # Scores large enough for the softcap to bend them (scale applied before the cap).
    for out, want_bf16_q, want in run_case(8, 2, 64, 16, SHAPES, window, softcap, seed=window):
        check(amx, out, want_bf16_q, want)


def test_tiles_round_q_to_bf16(amx: bool) -> None:
    """The tile path is measurably the bf16-q one (so the tests above can tell the two
    paths apart), and the FMA loop, switched back, still keeps float32 q exactly."""
    if not amx:
        pytest.skip("no AVX512-BF16 here: the FMA loop runs either way")
    results = run_case(12, 4, 64, 16, [(48, 20)], seed=3)
    out, want_bf16_q, want_f32_q = results[0]
    assert (out.double() - want_bf16_q).abs().max() < (out.double() - want_f32_q).abs().max()
    cpu_kernels.set_attention_amx(False)
    assert not cpu_kernels.attention_amx_active() and cpu_kernels.attention_tiles() is None
    out, _, want_f32_q = run_case(12, 4, 64, 16, [(48, 20)], seed=3)[0]
    torch.testing.assert_close(out, want_f32_q.float(), atol=2e-5, rtol=1e-4)


def test_rows_do_not_depend_on_their_tile(amx: bool) -> None:
    """A row's output is the same whether its tile holds 16 rows or fewer (the other rows'
    keys add exact zeros): the C step and the module path tile alike, but a verification
    row must not change with its neighbours either."""
    # Rows 0..4 of a 5-row query against rows 0..4 of a 16-row one: same q, same keys.
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(4, 2, 64, 16, generator=g).bfloat16()
    v_cache = torch.randn(4, 2, 16, 64, generator=g).bfloat16()
    q = torch.randn(16, 4, 64, generator=g)
    outs = []
    for q_len in (16, 5):
        out = torch.zeros(q_len, 4, 64)
        cpu_kernels.paged_attention(
            q[:q_len], k_cache, v_cache, out, torch.tensor([0]), torch.tensor([q_len]),
            torch.tensor([30 + q_len]), torch.tensor([[2, 0, 3]]), 16, 0.125,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0][:5], outs[1])


def test_shapes_the_tiles_do_not_take_use_the_fma_loop(amx: bool) -> None:
    """Head sizes not a multiple of 32 and blocks not a multiple of 16 keep the FMA loop
    (float32 q: the tight tolerance holds)."""
    for shape in ((8, 2, 48, 16), (8, 2, 64, 8)):
        for out, _, want_f32_q in run_case(*shape, SHAPES, seed=shape[2]):
            torch.testing.assert_close(out, want_f32_q.float(), atol=2e-5, rtol=1e-4)


def test_bench_tool_runs(amx: bool, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    if not amx:
        pytest.skip("no AVX512-BF16 here: the tool refuses to compare")
    from fleetserve.bench import attention_tiles

    monkeypatch.setattr(attention_tiles, "SHAPES", [(2, 20, 5)])
    monkeypatch.setattr("sys.argv", ["attention_tiles", "--calls", "1"])
    attention_tiles.main()
    assert "(2, 20, 5)" in capsys.readouterr().out


def test_environment_switches_the_tiles_off(amx: bool) -> None:
    """FLEETSERVE_ATTENTION_AMX=0 keeps the FMA loop for the whole process, FLEETSERVE_AMX=0
    only AMX (the vdpbf16ps blocks take over where AVX512-BF16 is there); read at first
    use, the library opened without torch, so the child starts in a moment. Printed:
    attention_amx_active, attention_tiles_kind (2 AMX, 1 vdpbf16ps, 0 none)."""
    code = (
        "from fleetserve.kernels import library\n"
        "lib = library.open_library()\n"
        "print(lib.attention_amx_active(), lib.attention_tiles_kind())\n"
    )
    run = functools.partial(
        subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    has_amx = cpu_kernels.attention_amx_active()
    kind = {"amx": 2, "avx512_bf16": 1, None: 0}[cpu_kernels.attention_tiles()]
    assert run(env={**os.environ, "FLEETSERVE_ATTENTION_AMX": "0"}).stdout.split() == ["0", "0"]
    assert run(env={**os.environ, "FLEETSERVE_AMX": "0"}).stdout.split() == ["0", str(int(amx))]
    assert run(env={**os.environ, "FLEETSERVE_ATTENTION_AMX": "1"}).stdout.split() == [
        str(int(has_amx)),
        str(kind),
    ]
