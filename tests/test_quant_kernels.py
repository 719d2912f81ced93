"""quant_gemm.c against the gguf package: block decoding against gguf.quants.dequantize,
and the GEMM against dequantize-then-matmul (float64) for decode- and prefill-sized m."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.quant import BLOCK_SHAPES, QType, QuantWeight, quant_embedding, quant_linear

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

# Formats gguf.quants can quantize; the K-quants are built from random bytes instead.
_QUANTIZABLE = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)
# Offset of each half-float scale field in a block, to keep random blocks finite.
_HALF_FIELDS = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


def _random_blocks(qtype: QType, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: weights of N(0, 0.05) quantized, or random K-quant blocks
    whose scale fields are sane half floats."""
    rng = np.random.default_rng(seed)
    if qtype in _QUANTIZABLE:
        w = rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32)
        return quantize(w, GGMLQuantizationType(qtype))
    block, nbytes = BLOCK_SHAPES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for off in _HALF_FIELDS[qtype]:
        half = rng.uniform(1e-4, 2e-3, (rows, cols // block)).astype(np.float16)
        data[:, :, off : off + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def _reference(blocks: np.ndarray, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType(qtype)).astype(np.float32))


@pytest.mark.parametrize("qtype", list(QType))
def test_block_decoding_matches_gguf(qtype: QType) -> None:
    cols = 512
    blocks = _random_blocks(qtype, 37, cols, seed=int(qtype))
    w = QuantWeight(qtype, blocks, cols)
    want = _reference(blocks, qtype)
    # Exact: both decode each weight with one multiply-add in float32 (the fused add may
    # round once less, hence the ulp-sized tolerance).
    torch.testing.assert_close(w.dequantize(), want, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([[5, 0], [36, 5]])
    torch.testing.assert_close(quant_embedding(ids, w), want[ids], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("m", [1, 3, 4, 7, 8, 9, 40, 300])
def test_gemm_matches_dequantize_then_matmul(qtype: QType, m: int) -> None:
    n, k = 77, 512  # n not a multiple of any panel width: trims the last panel
    blocks = _random_blocks(qtype, n, k, seed=100 + int(qtype))
    w = QuantWeight(qtype, blocks, k)
    torch.manual_seed(m)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    ref = x.double() @ _reference(blocks, qtype).double().T
    # float32 accumulation over k=512 in another order: relative error ~1e-6 of the
    # output's scale, bounded here at 1e-4 of it.
    scale = float(ref.abs().max())
    tol = dict(rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(quant_linear(x, w).double(), ref, **tol)
    torch.testing.assert_close(quant_linear(x, w, bias).double(), ref + bias.double(), **tol)


def test_gemm_writes_into_a_column_slice_and_takes_strided_rows() -> None:
    n, k = 64, 256
    blocks = _random_blocks(QType.Q4_1, n, k, seed=7)
    w = QuantWeight(QType.Q4_1, blocks, k)
    wide = torch.randn(20, 2 * k)
    x = wide[:, ::2]  # strided columns: copied to contiguous rows first
    for rows in (2, 20):
        out = torch.zeros(rows, 3 * n)
        quant_linear(x[:rows], w, out=out[:, n : 2 * n])
        ref = x[:rows].double() @ _reference(blocks, QType.Q4_1).double().T
        torch.testing.assert_close(out[:, n : 2 * n].double(), ref, rtol=1e-4, atol=1e-4)
        assert out[:, :n].abs().sum() == 0 and out[:, 2 * n :].abs().sum() == 0


def test_bad_inputs_raise() -> None:
    blocks = _random_blocks(QType.Q8_0, 4, 64, seed=1)
    with pytest.raises(ValueError, match="multiple"):
        QuantWeight(QType.Q8_0, blocks, 48)
    with pytest.raises(ValueError, match="qtype"):
        QuantWeight(1, blocks, 64)
    w = QuantWeight(QType.Q8_0, blocks, 64)
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.ones(2, 32), w)
    with pytest.raises(IndexError):
        quant_embedding(torch.tensor([4]), w)
    # Few ids are checked as Python ints, many by numpy: both refuse either end.
    for ids in ([0, -1], [3] * 64 + [4], [-1] + [0] * 70, [0] * 70 + [4]):
        with pytest.raises(IndexError):
            quant_embedding(torch.tensor(ids), w)
    assert quant_embedding(torch.tensor([3] * 65), w).shape == (65, 64)
    assert quant_embedding(torch.zeros(0, dtype=torch.long), w).shape == (0, 64)
    assert quant_linear(torch.ones(0, 64), w).shape == (0, 4)
