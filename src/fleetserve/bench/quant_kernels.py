"""`fleetserve bench kernels`: GFLOP/s of the quantized GEMM at decode shapes.

Each format (random weights of N(0, 0.05), quantized by the gguf package) at SmolLM2-
135M's projection shapes, x of m rows, float32 activations against int8 activations
(quant_dot.c), timed back to back in one process on ``--num-threads`` threads. The build
is whatever `kernels.cpu` compiles for this process: set FLEETSERVE_CPU_MARCH (e.g.
x86-64-v3) to time a narrower target's kernels on this CPU. The figure is
2 * m * n * k / CPU time of the process per call (all threads' time: on a loaded machine
it moves less than wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import torch

# (name, out_features, in_features) of SmolLM2-135M's projections and LM head.
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", default="Q8_0,Q4_0,Q4_1")
    p.add_argument("--rows", default="1,4", help="comma-separated m (rows of x)")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement")
    p.add_argument("--json", default=None, help="write the figures here")


def _time_pair(x: torch.Tensor, a: Any, b: Any, min_time: float) -> tuple[float, float]:
    """CPU seconds per ``quant_linear(x, a)`` and per ``quant_linear(x, b)``: medians of
    5 runs of at least min_time / 10 each, the two alternating so that a change of load
    falls on both."""
    from fleetserve.kernels.quant import quant_linear

    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(5):
        for w, out in ((a, runs[0]), (b, runs[1])):
            quant_linear(x, w)
            calls, t0 = 0, time.process_time()
            while (elapsed := time.process_time() - t0) < min_time / 10 or calls < 3:
                quant_linear(x, w)
                calls += 1
            out.append(elapsed / calls)
    return sorted(runs[0])[2], sorted(runs[1])[2]


def run(args: argparse.Namespace) -> int:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    from fleetserve.kernels.quant import QType, QuantWeight

    torch.set_num_threads(args.num_threads)
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    march = os.environ.get("FLEETSERVE_CPU_MARCH", "native")
    print(f"build -march={march}, {args.num_threads} thread(s); GFLOP/s (CPU time)")
    print(f"{'format':6} {'shape':>16} {'m':>2} {'float32 x':>10} {'int8 x':>8} {'ratio':>6}")
    for fmt in args.formats.split(","):
        qtype = QType[fmt]
        for name, n, k in SHAPES:
            w = rng.normal(0.0, 0.05, (n, k)).astype(np.float32)
            blocks = quantize(w, GGMLQuantizationType(qtype))
            plain = QuantWeight(qtype, blocks, k)
            dot = QuantWeight(qtype, blocks, k, int8_activations=True)
            for m in rows:
                x = torch.randn(m, k)
                flops = 2.0 * m * n * k
                t_f32, t_i8 = _time_pair(x, plain, dot, args.min_time)
                f32, i8 = flops / t_f32 / 1e9, flops / t_i8 / 1e9
                results.append(
                    dict(format=fmt, shape=name, n=n, k=k, m=m, float32=f32, int8=i8, march=march)
                )
                print(f"{fmt:6} {name + f' {n}x{k}':>16} {m:>2} {f32:>10.1f} {i8:>8.1f} "
                      f"{i8 / f32:>5.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
