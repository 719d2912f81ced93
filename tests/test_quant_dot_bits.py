"""The integer dot kernels' float results, bit for bit (kernels/quant_dot.h's qdot_scale).

Per output, per block of 32 inputs in order, the SIMD kernels (AVX-512 VNNI, AMX-INT8,
AVX2) compute: is = the block's exact integer dot product of the weight quants (less
their offset) with x's int8 quants; acc = fma(float(is), fl(d_w * d_x), acc); for Q4_1
/ Q5_1 then acc = fma(m_w, fl(d_x * float(sum q_x)), acc). This file replays that
sequence in exact rational arithmetic, rounded to float32 once per operation, and asks
for the same bits at the row counts that take each kernel and split (1-row and 2-row
chains, 3-8 row passes, 9-16 rows in one pass of the wide VNNI kernel, even passes of up
to 8 past 16, AMX tiles of 16 and their tails, Q4 / Q5 with and without their quants
unpacked at load). A kernel
change that reorders or fuses the float steps changes greedy tokens against the module
path and earlier runs; this is where it shows. The portable C kernel (x86-64 builds
and non-x86) scales in another order and is not pinned here.
"""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.quant import (
    DOT_QTYPES,
    QType,
    QuantWeight,
    int8_dot_kernel,
    quant_linear,
    quantize_activations,
)

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or int8_dot_kernel() is None,
    reason="no SIMD integer dot kernel in this build",
)


def _round32(v: Fraction) -> float:
    """v rounded to the nearest float32 (ties to even), subnormals included."""
    if v == 0:
        return 0.0
    sign, v = (-1.0 if v < 0 else 1.0), abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    e = max(e, -126)
    scaled = v * Fraction(2) ** (23 - e)
    n, rem = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * rem
    if twice > scaled.denominator or (twice == scaled.denominator and n % 2):
        n += 1
    return sign * n * 2.0 ** (e - 23)


def _fma32(a: float, b: float, c: float) -> float:
    return _round32(Fraction(a) * Fraction(b) + Fraction(c))


def _split(
    qtype: QType, blocks: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """GGUF blocks as (d, m, signed-less-offset quants [n, k / 32, 32]) in float32 / int."""
    n, nb = blocks.shape[0], k // 32
    raw = blocks.reshape(n, nb, -1)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = qtype in (QType.Q4_1, QType.Q5_1)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if mins else None
    at = 4 if mins else 2
    if qtype == QType.Q8_0:
        return d, m, raw[..., 2:].view(np.int8).astype(np.int64)
    qh = None
    if qtype in (QType.Q5_0, QType.Q5_1):
        qh = raw[..., at : at + 4].copy().view("<u4")[..., 0].astype(np.int64)
        at += 4
    qs = raw[..., at : at + 16].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if qh is not None:
        q |= ((qh[..., None] >> np.arange(32)) & 1) << 4
    offset = {QType.Q4_0: 8, QType.Q5_0: 16}.get(qtype, 0)
    return d, m, q - offset


def _replay(qtype: QType, blocks: np.ndarray, x: torch.Tensor) -> np.ndarray:
    rows, k = x.shape
    d_w, m_w, q_w = _split(qtype, blocks, k)
    q_t, d_t = quantize_activations(x)
    xq = q_t.numpy().astype(np.int64).reshape(rows, k // 32, 32)
    xd = d_t.numpy()
    isum = np.einsum("nbi,rbi->rnb", q_w, xq)  # exact integers
    xs = xq.sum(-1).astype(np.float32)
    out = np.zeros((rows, blocks.shape[0]), dtype=np.float32)
    for r in range(rows):
        for j in range(blocks.shape[0]):
            acc = 0.0
            for b in range(k // 32):
                scale = float(np.float32(d_w[j, b]) * xd[r, b])
                acc = _fma32(float(isum[r, j, b]), scale, acc)
                if m_w is not None:
                    acc = _fma32(float(m_w[j, b]), float(xd[r, b] * xs[r, b]), acc)
            out[r, j] = acc
    return out


def _amx_int8() -> bool:
    with open("/proc/cpuinfo") as f:
        return " amx_int8" in f.read() and os.environ.get("FLEETSERVE_AMX", "1") != "0"


@pytest.mark.parametrize("copy", [True, False], ids=["amx-copy", "packed"])
@pytest.mark.parametrize("qtype", DOT_QTYPES)
def test_kernels_follow_the_documented_float_order(
    qtype: QType, copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy: Q4 / Q5 weights with their quants unpacked to bytes at load (quant_dot.h's
    QDOT_AMX: AMX tiles read them from 10 rows), or only the packed panels (nibbles
    unpacked per block on AMX, VNNI below 16 rows): the same bits either way."""
    monkeypatch.setenv("FLEETSERVE_AMX_COPY", "1" if copy else "0")
    n, k = 20, 128  # a whole panel of 16 and a trimmed one; 4 blocks
    w = np.random.default_rng(40 + int(qtype)).normal(0.0, 0.05, (n, k)).astype(np.float32)
    blocks = quantize(w, GGMLQuantizationType(qtype))
    weight = QuantWeight(qtype, blocks, k, int8_activations=True)
    made = copy and qtype != QType.Q8_0 and _amx_int8() and int8_dot_kernel() == "AVX-512 VNNI"
    assert (weight.amx_copy_bytes > 0) == made
    x = torch.randn(42, k, generator=torch.Generator().manual_seed(int(qtype)))
    x[4, 32:64] = 0  # an all-zero block: d_x 0
    x[6] *= 1e-36  # tiny scales: subnormal products
    want = _replay(qtype, blocks, x)
    for m in (1, 2, 3, 5, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 26, 35, 42):
        got = quant_linear(x[:m], weight).numpy()
        np.testing.assert_array_equal(got.view(np.int32), want[:m].view(np.int32), err_msg=str(m))
