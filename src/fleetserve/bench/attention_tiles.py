"""Prefill attention: bf16 tiles (AMX-BF16 or vdpbf16ps) against the FMA loop, kernel alone.

`python -m fleetserve.bench.attention_tiles [--threads T] [--calls N]` times
`kernels.cpu.paged_attention` over a bf16 cache (random values, shuffled blocks, the bench
Llama's 12 query / 4 kv heads of 64) for prefill-shaped calls (prompts from scratch, a
chunk after a cached prefix, short verification-sized queries), the tiles on and off
alternated in one process: best of N calls, ms (thread CPU time at one thread, wall time
past it). Shapes: (sequences, query rows each, cached context each).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fleetserve.kernels import cpu

SHAPES = [(8, 293, 0), (1, 1024, 0), (4, 256, 512), (13, 78, 0), (16, 8, 300), (32, 3, 300)]


def _call(seqs: int, rows: int, ctx: int, seed: int = 0) -> Callable[[], None]:
    heads, kv_heads, hd, bs = 12, 4, 64, 16
    g = torch.Generator().manual_seed(seed)
    per = -(-(rows + ctx) // bs)
    blocks = seqs * per + 2
    k_cache = torch.randn(blocks, kv_heads, hd, bs, generator=g).bfloat16()
    v_cache = torch.randn(blocks, kv_heads, bs, hd, generator=g).bfloat16()
    tables = torch.randperm(blocks, generator=g)[: seqs * per].view(seqs, per).contiguous()
    q = torch.randn(seqs * rows, heads, hd, generator=g)
    out = torch.empty_like(q)
    starts, lens = torch.arange(seqs) * rows, torch.full((seqs,), rows)
    seq_lens = torch.full((seqs,), rows + ctx)
    return lambda: cpu.paged_attention(
        q, k_cache, v_cache, out, starts, lens, seq_lens, tables, bs, hd**-0.5
    )


def _best(f: Callable[[], None], calls: int, clock: Callable[[], float]) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = clock()
        f()
        best = min(best, clock() - t0)
    return 1000 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=9)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    if cpu.load() is None:
        raise SystemExit("no C kernels here")
    cpu.set_attention_amx(True)
    kind = cpu.attention_tiles()
    if kind is None:
        raise SystemExit("no bf16 tiles here (no AVX512-BF16 in the CPU or the build)")
    print(f"shape (seqs, rows, ctx)     FMA loop ms   {kind:>11} ms   ratio")
    for shape in SHAPES:
        f = _call(*shape)
        ms: dict[bool, list[float]] = {False: [], True: []}
        for mode in (False, True, False, True):
            cpu.set_attention_amx(mode)
            ms[mode].append(_best(f, a.calls, clock))
        fma, tiles = min(ms[False]), min(ms[True])
        print(f"{shape!s:<26} {fma:8.2f} {tiles:16.2f} {fma / tiles:9.2f}x", flush=True)
    cpu.set_attention_amx(None)


if __name__ == "__main__":
    main()
