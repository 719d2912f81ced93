"""bf16 weights as [n, k] rows (gemm_bf16.c) against the same weights as AMX B tiles
(gemm_bf16_tiled.c), interleaved round by round, one thread, thread CPU time:
`python -m fleetserve.bench.bf16_tiles [--rounds 3] [--threads 1] [--tiles-only]`.
Decode-sized shapes cycle through as many weights as a bench-Llama step has layers (12),
so each call reads its weights from memory as a step does. The first line is the core's
own `vdpbf16ps` rate (operands in registers: gemm_bf16.c's bf16_dot_peak), against which
each shape's rate is also given as a share. Noisy on a shared machine: figures go in
docs/benchmarks.md with the load they were taken under."""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from collections.abc import Callable

import torch

from fleetserve.kernels.bf16 import Bf16Weight, gemm_bf16, tile_bf16

PREFILL = [(1024, 2304, 768), (1024, 4096, 768), (1024, 768, 2048)]
DECODE = [
    (64, 2304, 768), (64, 4096, 768), (64, 768, 2048), (32, 4096, 768), (24, 4096, 768),
    (16, 4096, 768), (8, 4096, 768), (4, 4096, 768), (1, 4096, 768),
]  # fmt: skip
LAYERS = 12


def _clock(threads: int) -> Callable[[], float]:
    # One thread: the OpenMP team is the calling thread, whose CPU time is exact under
    # load; more threads: wall time.
    return time.thread_time if threads == 1 else time.perf_counter


def _best_ms(
    x: torch.Tensor, ws: list[Bf16Weight], threads: int, clock: Callable[[], float]
) -> float:
    """Best of 3 passes over ws (one call per weight), ms per call."""
    best = float("inf")
    gemm_bf16(x, ws[0], threads)
    for _ in range(3):
        t0 = clock()
        for w in ws:
            gemm_bf16(x, w, threads)
        best = min(best, (clock() - t0) / len(ws))
    return best * 1e3


def peak_gflops(clock: Callable[[], float] = time.thread_time) -> float:
    """One core's `vdpbf16ps` GFLOP/s with its operands in registers (best of 3; 0: the
    library has no AVX512-BF16)."""
    from fleetserve.kernels import cpu

    fn = cpu._lib().bf16_dot_peak
    fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_float
    iters, best = 2_000_000, 0.0
    for _ in range(3):
        t0 = clock()
        fn(iters)
        dt = clock() - t0
        best = max(best, iters * 16 * 64 / dt / 1e9 if dt > 0 else 0.0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiles-only", action="store_true", help="leave out the rows kernel")
    p.add_argument("--shapes", default=None, help="MxNxK,... (default: the built-in list)")
    args = p.parse_args()
    clock = _clock(args.threads)
    peak = peak_gflops() * args.threads
    print(
        f"threads {args.threads}, FLEETSERVE_AMX={os.environ.get('FLEETSERVE_AMX', '1')}, "
        f"vdpbf16ps peak {peak:.0f} GFLOP/s ({args.threads} x one core, registers only)"
    )
    shapes = PREFILL + DECODE
    if args.shapes:
        shapes = []
        for s in args.shapes.split(","):
            m, n, k = (int(v) for v in s.split("x"))
            shapes.append((m, n, k))
    for m, n, k in shapes:
        copies = 1 if (m, n, k) in PREFILL else LAYERS
        rows = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        tiles = [tile_bf16(w) for w in rows]
        x = torch.randn(m, k)
        assert all(
            torch.equal(gemm_bf16(x, r), gemm_bf16(x, t)) for r, t in zip(rows, tiles, strict=True)
        )
        got: dict[str, list[float]] = (
            {"tiles": []} if args.tiles_only else {"rows": [], "tiles": []}
        )
        for _ in range(args.rounds):
            if not args.tiles_only:
                got["rows"].append(_best_ms(x, rows, args.threads, clock))  # type: ignore[arg-type]
            got["tiles"].append(_best_ms(x, tiles, args.threads, clock))
        line = [f"{m} x {n} x {k}:"]
        for name, ms in got.items():
            tf = [2 * m * n * k / t / 1e9 for t in ms]
            gbs = [n * k * 2 / t / 1e6 for t in ms]
            share = f", {max(tf) * 1e3 / peak:.0%} of peak" if peak else ""
            line.append(
                f"{name} {min(ms):.3f}-{max(ms):.3f} ms ({min(tf):.2f}-{max(tf):.2f} TFLOP/s"
                f"{share}, {min(gbs):.1f}-{max(gbs):.1f} GB/s of weights)"
            )
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
