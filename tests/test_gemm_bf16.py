"""kernels/gemm_bf16.c against torch: the same bf16-rounded operands, float32 sums."""

import pytest
import torch

from fleetserve.engine.dtype_choice import cpu_flags
from fleetserve.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double() @ w.double().T


@pytest.mark.parametrize(
    "m,n,k", [(1, 64, 64), (3, 17, 96), (8, 33, 100), (2, 5, 7), (5, 9, 64), (4, 40, 128)]
)
def test_matches_torch_on_bf16_operands(m: int, n: int, k: int) -> None:
    from fleetserve.kernels.bf16 import gemm_bf16

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    got = gemm_bf16(x, w, threads=2)
    torch.testing.assert_close(got.double(), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_strided_rows_and_bad_input() -> None:
    from fleetserve.kernels.bf16 import gemm_bf16

    big = torch.randn(4, 160)
    x = big[:, :128]
    w = torch.randn(16, 128).bfloat16()
    torch.testing.assert_close(gemm_bf16(x, w).double(), _reference(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="weight"):
        gemm_bf16(x, w.float())
    with pytest.raises(ValueError, match="columns"):
        gemm_bf16(x, torch.randn(16, 64).bfloat16())


def test_native_path_where_the_cpu_has_it() -> None:
    from fleetserve.kernels.bf16 import native

    march = __import__("os").environ.get("FLEETSERVE_CPU_MARCH", "native")
    assert native() == ("avx512_bf16" in cpu_flags() and march == "native")
