"""The `vdpbf16ps` bf16 GEMM (kernels/bf16_block.h, gemm_bf16.c, gemm_bf16_tiled.c without
AMX) against a plain-torch replay of its documented float32 order, bit for bit: each of
an output's 16 lanes is one chain over the 32-input chunks (lane p adds the product of
inputs 2p + 1, then of 2p: the instruction's order), the lanes are summed in
_mm512_reduce_add_ps's tree (lane i + lane i + 8, then + 4, + 2, + 1), then the bias.
Row counts cross the kernels' chunks of rows at 1 and 2 threads, so a change to how a
call's rows are split (chunks, threads, blocks) that moved any row's sums fails here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fleetserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

# Rows across the L2 chunks (k = 768: up to 324 rows a chunk, k = 2048: 124), ragged last
# groups of 4, n-blocks of 16 and weight rows past the last whole 16 (dot_row).
SHAPES = [
    (1, 48, 64), (3, 16, 768), (37, 53, 768), (125, 32, 2048), (330, 48, 768),
    (700, 17, 768), (1030, 32, 768), (260, 16, 2048),
]  # fmt: skip


def replay(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] float32, w [n, k] bfloat16 (k % 32 == 0): the kernel's sums, replayed."""
    m, k = x.shape
    n = w.shape[0]
    xb, wf = x.bfloat16().float(), w.float()
    out = torch.empty(m, n)
    for r0 in range(0, m, 64):
        # [rows, n, chunk, lane, 2]: products of bf16 values are exact in float32
        p = (xb[r0 : r0 + 64, None, :] * wf[None, :, :]).view(-1, n, k // 32, 16, 2)
        acc = torch.zeros(p.shape[0], n, 16)
        for c in range(k // 32):
            acc = acc + p[:, :, c, :, 1]
            acc = acc + p[:, :, c, :, 0]
        for half in (8, 4, 2, 1):
            acc = acc[..., :half] + acc[..., half:]
        out[r0 : r0 + 64] = acc[..., 0]
    return out if bias is None else out + bias


def mismatches() -> list[str]:
    """Calls whose outputs are not the replay's bits: rows and (where they untile) tiles,
    1 and 2 threads, with and without bias."""
    from fleetserve.kernels.bf16 import gemm_bf16, tile_bf16

    x, w, want = _order_case()
    bad = [] if gemm_bf16(x, w, 1).item() == want else ["the order case"]
    for m, n, k in SHAPES:
        g = torch.Generator().manual_seed(m * 131 + n * 7 + k)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g)
        for b in (None, bias):
            want = replay(x, w, b)
            for weight in (w, tile_bf16(w)):
                for threads in (1, 2):
                    got = gemm_bf16(x, weight, threads, b)
                    if not torch.equal(got, want):
                        rows = (got != want).any(dim=1).nonzero().flatten().tolist()
                        bad.append(
                            f"{m}x{n}x{k} {type(weight).__name__} threads={threads} "
                            f"bias={b is not None}: rows {rows[:8]}"
                        )
    return bad


def _order_case() -> tuple[torch.Tensor, torch.Tensor, float]:
    """One output whose bits tell the orders apart: lane 0 holds 1 after the first chunk,
    then adds 2^-24 (input 33, odd) and -2^-24 (input 32, even). Odd first: 1 + 2^-24
    rounds to 1 (a tie, to even), then 1 - 2^-24 is exact; even first gives 1, and so
    does adding the pair's sum (0) at once."""
    x = torch.zeros(1, 64)
    w = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 1], w[0, 1] = 1.0, 1.0
    x[0, 32], w[0, 32] = -(2.0**-12), 2.0**-12
    x[0, 33], w[0, 33] = 2.0**-12, 2.0**-12
    return x, w, 1.0 - 2.0**-24


def test_replay_is_the_instructions_order() -> None:
    x, w, want = _order_case()
    assert replay(x, w, None).item() == want


@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), reason="no AVX-512"
)
def test_gemm_bf16_sums_in_its_documented_order() -> None:
    """Where the library runs `vdpbf16ps` (AMX off: FLEETSERVE_AMX=0, read once per
    process, so a subprocess): every output equals the replay's bits."""
    from fleetserve.kernels.bf16 import native

    if not native():
        pytest.skip("the kernel library has no AVX512-BF16 here")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_bf16_sum_order as t;"
        "bad = t.mismatches(); print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)],
        env={**os.environ, "FLEETSERVE_AMX": "0"}, timeout=600, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
