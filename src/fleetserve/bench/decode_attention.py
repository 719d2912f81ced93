"""Decode attention alone, on the offline run's widest decode step.

`python -m fleetserve.bench.decode_attention [--capture PATH] [--threads T] [--hot]
[--kv-dtype float32|bfloat16]`

First call (`--capture PATH` missing): runs the workload through `offline_split.split`
(1 thread) and saves the widest decode step's metadata (query starts, lengths, context
lengths, block tables) and its caches' shapes to PATH. Then: `paged_attention` over fresh
random caches of those shapes, one per layer (as the model has), with that metadata;
best of N, thread CPU time at 1 thread (wall past one), and the K/V bytes read per ms;
`--kv-dtype` replays it over caches of another dtype than the run's.
`--hot` points every sequence at one sequence's blocks (its keys and values stay in L2):
the loop's compute rate without the memory system.
`--ab` (a bf16 cache): the rows with bf16 products (kernels/paged_decode_bf16.h) and with
the float32 FMA loop (`set_attention_amx(False)`), alternated in one process, best of each.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch


def capture(path: str, workload: str) -> None:
    """Run the workload once and save its widest decode step's attention inputs."""
    from fleetserve.bench import offline_split
    from fleetserve.bench.offline import bench_model_path

    def keep(model: Any, run: Any, args: list[Any], clock: Any) -> dict[str, float]:
        if bool((args[5] == 1).all()):  # q_lens: a decode step
            at = model.decoder_layers()[0].self_attn
            torch.save(
                {
                    "meta": [a.clone() for a in args[4:8]],
                    "k_shape": tuple(at.attn.k_cache.shape),
                    "v_shape": tuple(at.attn.v_cache.shape),
                    "dtype": str(at.attn.k_cache.dtype),  # "torch.bfloat16"
                    "layers": len(model.decoder_layers()),
                    "scale": at.attn.scale,
                    "heads": at.num_heads,
                },
                path,
            )
        return {}

    replay, offline_split.replay = offline_split.replay, keep  # type: ignore[assignment]
    try:
        offline_split.split(bench_model_path(), workload, 1)
    finally:
        offline_split.replay = replay  # type: ignore[assignment]


def time_step(
    path: str, threads: int, hot: bool, reps: int, kv_dtype: str | None = None,
    products: tuple[bool | None, ...] = (None,),
) -> dict[bool | None, dict[str, float]]:  # fmt: skip
    """Best ms of the step's attention over all layers, and GB/s of K/V read, for each
    setting of the bf16 products switch in `products` (None: the environment's), the
    settings alternated rep by rep."""
    from fleetserve.kernels import cpu

    torch.set_num_threads(threads)
    d = torch.load(path)
    dtype = getattr(torch, kv_dtype or d["dtype"].removeprefix("torch."))
    q_starts, q_lens, seq_lens, tables = d["meta"]
    if hot:
        i = int((seq_lens - seq_lens.float().mean()).abs().argmin())
        seq_lens = torch.full_like(seq_lens, int(seq_lens[i]))
        tables = tables[i : i + 1].expand_as(tables).contiguous()
    g = torch.Generator().manual_seed(0)
    caches = [
        (
            torch.randn(d["k_shape"], generator=g).to(dtype),
            torch.randn(d["v_shape"], generator=g).to(dtype),
        )
        for _ in range(d["layers"])
    ]
    head_dim = d["k_shape"][2]
    q = torch.randn(q_starts.numel(), d["heads"], head_dim, generator=g)
    out = torch.empty_like(q)
    clock = time.thread_time if threads == 1 else time.perf_counter

    def run() -> None:
        for k, v in caches:
            cpu.paged_attention(q, k, v, out, q_starts, q_lens, seq_lens, tables, 16, d["scale"])

    best = dict.fromkeys(products, float("inf"))
    try:
        for rep in range(reps + 1):
            for mode in products:
                cpu.set_attention_amx(mode)
                t0 = clock()
                run()
                if rep:  # the first round warms up
                    best[mode] = min(best[mode], clock() - t0)
    finally:
        cpu.set_attention_amx(None)
    kv_heads, elem = d["k_shape"][1], caches[0][0].element_size()
    nbytes = int(seq_lens.sum()) * kv_heads * head_dim * elem * 2 * d["layers"]
    return {
        mode: {"ms": 1000 * t, "mb": nbytes / 1e6, "gb_s": nbytes / t / 1e9}
        for mode, t in best.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--capture", default="/tmp/fleetserve-decode-step.pt")
    p.add_argument("--workload", default="/work/shared/bench/workload.json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--hot", action="store_true")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--ab", action="store_true")
    args = p.parse_args()
    if not os.path.exists(args.capture):
        capture(args.capture, args.workload)
    products: tuple[bool | None, ...] = (False, True) if args.ab else (None,)
    results = time_step(args.capture, args.threads, args.hot, args.reps, args.kv_dtype, products)
    names = {None: "", False: ", float32 FMA loop", True: ", bf16 products"}
    for mode, r in results.items():
        print(
            f"decode attention, {args.threads} thread(s){', hot' if args.hot else ''}"
            f"{names[mode]}: {r['ms']:.2f} ms for {r['mb']:.0f} MB of K/V = "
            f"{r['gb_s']:.2f} GB/s"
        )


if __name__ == "__main__":
    main()
