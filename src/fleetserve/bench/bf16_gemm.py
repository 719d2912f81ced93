"""kernels/gemm_bf16.c against torch's F.linear in float32 and bfloat16 (oneDNN):
`OMP_NUM_THREADS=1 python -m fleetserve.bench.bf16_gemm [threads]`. Noisy on a shared
machine; figures go in docs/benchmarks.md with the load they were taken under."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fleetserve.kernels.bf16 import gemm_bf16, native

SHAPES = [(1, 2048, 2048), (1, 8192, 2048), (4, 8192, 2048), (8, 2048, 2048), (512, 2048, 768)]


def _ms(f: Callable[[], object], repeats: int = 20) -> float:
    f()
    start = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    print(f"vdpbf16ps: {native()}, threads: {threads}")
    for m, n, k in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        xb, wb = x.bfloat16(), w.bfloat16()
        ours = _ms(lambda: gemm_bf16(x, wb, threads))  # noqa: B023
        fp32 = _ms(lambda: F.linear(x, w))  # noqa: B023
        bf16 = _ms(lambda: F.linear(xb, wb))  # noqa: B023
        print(
            f"{m} x {n} x {k}: gemm_bf16 {ours:.3f} ms ({n * k * 2 / ours / 1e6:.1f} GB/s of "
            f"weights) | torch fp32 {fp32:.3f} ms | torch bf16 {bf16:.3f} ms"
        )


if __name__ == "__main__":
    main()
