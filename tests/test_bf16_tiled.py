"""bf16 weights laid out once as AMX B tiles (kernels/bf16.py `tile_bf16`,
kernels/gemm_bf16_tiled.c): the same outputs, bit for bit, as gemm_bf16.c over the [n, k]
rows at every row count, with and without AMX, so tokens and logprobs do not move with
the layout; a row's outputs do not depend on its call's other rows; `Linear.to_bf16`
keeps one layout, the one this CPU multiplies fastest."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import TiledBf16, gemm_bf16, tile_bf16, tiles_pay
from fleetserve.layers.linear import Linear

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

# Decode-sized rows (pairs of rows over the tiles), wider calls (untiled n-blocks, 4 rows
# x 4 outputs, ragged last group), AMX rows (one 16-row block, pairs, partial blocks,
# several L2 chunks), odd n-block counts.
SHAPES = [
    (1, 64, 64), (2, 48, 96), (3, 16, 128), (4, 32, 64), (5, 80, 160), (7, 96, 768),
    (8, 64, 2048), (9, 16, 64), (16, 32, 96), (17, 48, 256), (24, 96, 768), (33, 80, 320),
    (64, 112, 768), (300, 48, 768), (1100, 32, 768),
]  # fmt: skip


def _pair(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    return (
        torch.randn(m, k, generator=g),
        torch.randn(n, k, generator=g).bfloat16(),
        torch.randn(n, generator=g),
    )


def _compare(shapes: list[tuple[int, int, int]]) -> list[str]:
    bad = []
    for m, n, k in shapes:
        x, w, bias = _pair(m, n, k)
        t = tile_bf16(w)
        assert isinstance(t, TiledBf16)
        for threads in (1, 2):
            for b in (None, bias):
                want, got = gemm_bf16(x, w, threads, b), gemm_bf16(x, t, threads, b)
                if not torch.equal(want, got):
                    bad.append(f"{m}x{n}x{k} threads={threads} bias={b is not None}")
    return bad


def _alone() -> list[str]:
    """Rows whose outputs move when the call has other rows: each row of a 37-row call
    against the same row alone, and the first m rows against a call of m (decode-sized
    calls over the tiles as they are, wider ones untiled 4 rows x 4 outputs at a time)."""
    bad = []
    for n, k in ((48, 768), (32, 2048), (16, 96)):
        x, w, bias = _pair(37, n, k)
        for weight in (w, tile_bf16(w)):
            kind = type(weight).__name__
            for threads in (1, 2):
                full = gemm_bf16(x, weight, threads, bias)
                for m in (1, 2, 3, 4, 5, 8, 15, 16, 17, 20, 36):
                    if not torch.equal(gemm_bf16(x[:m], weight, threads, bias), full[:m]):
                        bad.append(f"{kind} {m} of 37 rows {n}x{k} threads={threads}")
                for r in (0, 5, 36):
                    if not torch.equal(
                        gemm_bf16(x[r : r + 1], weight, threads, bias), full[r : r + 1]
                    ):
                        bad.append(f"{kind} row {r} alone {n}x{k} threads={threads}")
    return bad


def test_a_rows_sums_do_not_depend_on_the_other_rows() -> None:
    """Speculative verification rows against plain decoding, a request alone or in a
    batch: the same bits at every row count, with AMX or `vdpbf16ps` (FLEETSERVE_AMX=0,
    read once per process: a subprocess)."""
    assert _alone() == []
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_bf16_tiled as t;"
        "bad = t._alone(); print(bad); sys.exit(1 if bad else 0)"
    )
    env = {**os.environ, "FLEETSERVE_AMX": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)],
        env=env, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_blocks_give_the_single_row_dots_bits() -> None:
    """Weight rows past the last whole 16 go through dot_row (one row, one weight row),
    the others through the `vdpbf16ps` blocks (4 x 4, 2 x 8, 1 x 16): a weight row
    copied into the tail gives the same bits both ways, at every row count."""
    for k in (64, 768):
        x, w, bias = _pair(37, 17, k)
        w[16], bias[16] = w[5], bias[5]
        for m in (1, 2, 3, 4, 5, 7, 16, 37):
            out = gemm_bf16(x[:m], w.contiguous(), 2, bias)
            assert torch.equal(out[:, 16], out[:, 5]), (k, m)


def test_layout_round_trip_and_shapes_that_do_not_tile() -> None:
    w = torch.randn(48, 96)
    t = tile_bf16(w)
    assert isinstance(t, TiledBf16) and t.shape == (48, 96) and t.dtype == torch.bfloat16
    assert t.data.numel() == w.numel()  # the tiles replace the rows: no second copy
    assert torch.equal(t.rows(), w.bfloat16())
    # Tile (0, 1), pair 3 of row 5: inputs 32 + 6 and 32 + 7 of row 5.
    tile = t.data[512 : 2 * 512]
    assert torch.equal(tile[3 * 32 + 5 * 2 : 3 * 32 + 5 * 2 + 2], w.bfloat16()[5, 38:40])
    for n, k in ((17, 64), (16, 100), (8, 32)):
        rows = tile_bf16(torch.randn(n, k))
        assert isinstance(rows, torch.Tensor) and rows.is_contiguous() and rows.shape == (n, k)
    with pytest.raises(ValueError, match="2-D"):
        tile_bf16(torch.randn(4, 4, 4))


def test_tiles_give_the_rows_sums_bit_for_bit() -> None:
    assert _compare(SHAPES) == []


def test_without_amx_too() -> None:
    """FLEETSERVE_AMX=0 (read once per process): `vdpbf16ps` over the tiles, each lane a
    pair of the tile, reduced in the rows kernel's order."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_bf16_tiled as t;"
        "bad = t._compare(t.SHAPES); print(bad); sys.exit(1 if bad else 0)"
    )
    env = {**os.environ, "FLEETSERVE_AMX": "0"}
    here = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, "-c", code, here], env=env, timeout=300, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_strided_x_bias_and_bad_input() -> None:
    big = torch.randn(20, 160)
    x = big[:, :128]
    w = torch.randn(32, 128).bfloat16()
    t = tile_bf16(w)
    assert torch.equal(gemm_bf16(x, t), gemm_bf16(x.contiguous(), w))
    with pytest.raises(ValueError, match="columns"):
        gemm_bf16(torch.randn(3, 64), t)
    with pytest.raises(ValueError, match="bias"):
        gemm_bf16(x, t, bias=torch.randn(31))
    assert gemm_bf16(torch.randn(0, 128), t).shape == (0, 32)


def test_linear_keeps_one_layout_the_cpus_fastest() -> None:
    """Tiles where AMX multiplies them, else [n, k] rows (the `vdpbf16ps` blocks would
    untile each n-block first); one copy either way."""
    lin = Linear(64, 48, bias=True)
    x = torch.randn(5, 64)
    want = gemm_bf16(x, lin.weight.detach().bfloat16().contiguous(), bias=lin.bias.detach())
    lin.to_bf16()
    assert isinstance(lin.bf16, TiledBf16 if tiles_pay() else torch.Tensor)
    assert lin.weight.numel() == 0 and lin.bf16.numel() == 48 * 64
    assert torch.equal(lin(x), want)
    odd = Linear(40, 24, bias=False)  # 40 inputs: not a multiple of 32, rows kept
    odd.to_bf16()
    assert isinstance(odd.bf16, torch.Tensor)


@pytest.mark.slow  # builds the whole library once more (~30 s)
def test_portable_build_over_tiles() -> None:
    """Without AVX512-BF16 (an x86-64-v3 build of the library in its own cache) the
    tiles go through the portable loop: the same products, float32 sums close to the
    rows kernel's."""
    code = (
        "import torch; from fleetserve.kernels.bf16 import gemm_bf16, native, tile_bf16;"
        "assert not native();"
        "g = torch.Generator().manual_seed(1); x = torch.randn(12, 96, generator=g);"
        "w = torch.randn(32, 96, generator=g).bfloat16(); b = torch.randn(32, generator=g);"
        "torch.testing.assert_close(gemm_bf16(x, tile_bf16(w), bias=b),"
        " gemm_bf16(x, w, bias=b), rtol=1e-5, atol=1e-5)"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 only")
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "FLEETSERVE_CPU_MARCH": "x86-64-v3", "FLEETSERVE_CACHE": d}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True
        )
    assert out.returncode == 0, out.stdout + out.stderr
