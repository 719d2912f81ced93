"""Integer dot products (kernels/quant_dot.h): x quantized to int8 per block of 32, then
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights multiplied in integers, at decode and prefill row counts.

The reference is float64: the gguf package's dequantized weights times x dequantized from
the kernel's own int8 blocks (`quantize_activations`, itself checked against numpy). The
build under test is the one for this CPU; `test_other_targets` reruns this file and
test_quant_kernels.py with the library built for x86-64-v3 (AVX2, maddubs) and x86-64
(SSE2: the portable C) on x86 machines.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.quant import (
    DOT_QTYPES,
    QType,
    QuantWeight,
    quant_embedding,
    quant_linear,
    quantize_activations,
)

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def _blocks(qtype: QType, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).normal(0.0, 0.05, (n, k)).astype(np.float32)
    return quantize(w, GGMLQuantizationType(qtype))


def _weights(blocks: np.ndarray, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType(qtype))).double()


def _dequantized_x(x: torch.Tensor) -> torch.Tensor:
    q, d = quantize_activations(x)
    m, k = x.shape
    return (q.double().view(m, k // 32, 32) * d.double()[..., None]).view(m, k)


def test_activation_quantization_matches_numpy() -> None:
    x = torch.randn(5, 256) * torch.logspace(-3, 2, 5)[:, None]
    x[2, 32:64] = 0  # an all-zero block: scale 0, quants 0
    q, d = quantize_activations(x)
    xb = x.numpy().reshape(5, 8, 32)
    want_d = np.abs(xb).max(-1) / np.float32(127)
    np.testing.assert_allclose(d.numpy(), want_d, rtol=1e-6)
    inv = np.where(want_d > 0, 1 / np.where(want_d > 0, want_d, 1), 0).astype(np.float32)
    want_q = np.rint(xb * inv[..., None]).reshape(5, 256)
    diff = np.abs(q.numpy().astype(np.int32) - want_q)
    # Scale and reciprocal may round an ulp apart from numpy's: a quant off by one only
    # when x / d lands within ~1e-6 of a half, never in practice for random x.
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    assert int(q.abs().max()) == 127 and int(q[2, 32:64].abs().max()) == 0
    err = (torch.from_numpy(xb) - q.view(5, 8, 32).float() * d[..., None]).abs()
    assert bool((err <= d[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all())


@pytest.mark.parametrize("qtype", DOT_QTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13, 40])
def test_int8_gemm_matches_reference(qtype: QType, m: int) -> None:
    n, k = 77, 512  # 77 rows: 4 full panels of 16 and a trimmed one
    blocks = _blocks(qtype, n, k, seed=10 + int(qtype))
    w = QuantWeight(qtype, blocks, k, int8_activations=True)
    torch.manual_seed(m)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    ref = _dequantized_x(x) @ _weights(blocks, qtype).T
    # Integer block sums are exact; what remains is float32 rounding of the per-block
    # scale products and the sum of 16 blocks: ~1e-7 of the output's scale, bounded
    # here at 1e-5 of it.
    tol = dict(rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(quant_linear(x, w).double(), ref, **tol)
    torch.testing.assert_close(quant_linear(x, w, bias).double(), ref + bias.double(), **tol)
    # And against float32 x: the activation rounding costs ~0.5% of the output's scale.
    exact = x.double() @ _weights(blocks, qtype).T
    assert float((quant_linear(x, w).double() - exact).abs().max()) < 0.02 * float(
        exact.abs().max()
    )


@pytest.mark.parametrize("qtype", DOT_QTYPES)
def test_each_row_is_the_same_whatever_rows_share_its_call(qtype: QType) -> None:
    """A row's result does not depend on how many rows go through the kernel with it
    (1 to 15 rows: every split of the vector kernel's row groups): a speculative
    verification row gives bit for bit what the same token as a one-row decode gives,
    which is what keeps greedy outputs identical with and without drafts."""
    n, k = 40, 256
    blocks = _blocks(qtype, n, k, seed=3 + int(qtype))
    w = QuantWeight(qtype, blocks, k, int8_activations=True)
    torch.manual_seed(5)
    x = torch.randn(15, k)
    alone = torch.cat([quant_linear(x[i : i + 1], w) for i in range(15)])
    for m in range(2, 16):
        assert torch.equal(quant_linear(x[:m], w), alone[:m]), m


@pytest.mark.parametrize("qtype", DOT_QTYPES)
def test_dot_layout_decodes(qtype: QType) -> None:
    n, k = 45, 256
    blocks = _blocks(qtype, n, k, seed=int(qtype))
    w = QuantWeight(qtype, blocks, k, int8_activations=True)
    want = _weights(blocks, qtype).float()
    torch.testing.assert_close(w.dequantize(), want, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([44, 0, 17])
    torch.testing.assert_close(quant_embedding(ids, w), want[ids], rtol=1e-6, atol=1e-7)


def test_extreme_values_do_not_saturate() -> None:
    # The AVX2 kernels sum in int16 lanes: all-15 nibbles against x at +-127 is Q4's
    # worst case (30,480 per lane), and a Q8_0 quant of -128 (valid in the format,
    # never made by a quantizer) is where a sign trick would overflow.
    k, n = 64, 16
    x = torch.full((2, k), 3.0)
    x[1] = -3.0
    # Q5: all-31 quants (fifth bits and nibbles set), 8 products of 31 * 127 per int16
    # lane between widenings (31,496).
    fills = (
        (QType.Q4_0, 0xFF, 2), (QType.Q4_1, 0xFF, 4), (QType.Q5_0, 0xFF, 2),
        (QType.Q5_1, 0xFF, 4), (QType.Q8_0, 0x80, 2),
    )  # fmt: skip
    for qtype, fill, head in fills:  # head: the scale bytes left as quantized
        blocks = _blocks(qtype, n, k, seed=1)
        per_block = blocks.shape[1] // (k // 32)
        view = blocks.reshape(n, k // 32, per_block)
        view[:, :, head:] = fill
        w = QuantWeight(qtype, blocks, k, int8_activations=True)
        ref = _dequantized_x(x) @ _weights(blocks, qtype).T
        torch.testing.assert_close(
            quant_linear(x, w).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())
        )


def test_int8_activations_refused_for_k_quants() -> None:
    blocks = np.zeros((2, 144), dtype=np.uint8)
    with pytest.raises(ValueError, match="int8_activations"):
        QuantWeight(QType.Q4_K, blocks, 256, int8_activations=True)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_other_targets(march: str, tmp_path: Path) -> None:
    """This file and the float kernels' tests again, on the library built for `march`."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    here = Path(__file__).parent
    env = dict(os.environ, FLEETSERVE_CPU_MARCH=march, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "-k", "not test_other_targets", str(here / "test_quant_dot.py"),
         str(here / "test_quant_kernels.py")],
        env=env, capture_output=True, text=True, cwd=here.parent, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("qtype", DOT_QTYPES)
def test_a_row_does_not_depend_on_its_batch(qtype: QType) -> None:
    """Whole tiles of 16 rows may run on AMX-INT8 (quant_dot_amx.c) and the rest on the
    vector kernel: integer sums are exact and the scaling is the same instructions, so
    every row of a 37-row product equals that row multiplied alone, bit for bit (what
    keeps the decode step and the module path identical at any row count)."""
    n, k = 40, 320
    blocks = _blocks(qtype, n, k, seed=20 + int(qtype))
    w = QuantWeight(qtype, blocks, k, int8_activations=True)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(5))
    batch = quant_linear(x, w)
    for r in range(x.shape[0]):
        assert torch.equal(quant_linear(x[r : r + 1], w)[0], batch[r]), r
