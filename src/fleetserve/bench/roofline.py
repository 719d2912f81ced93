"""`fleetserve bench roofline`: the read bandwidth of the cores a decode step runs on, the
denominator of one stream's roofline (bytes a token reads x tokens/s against it).

kernels/read_probe.c streams a buffer on 1 and 2 threads (each thread its own
contiguous part, 64-byte AVX-512 loads into eight accumulators, best and median of
``--reps`` passes after a warm one) at two sizes:

- ``dram``: a buffer several times the last-level cache (``--dram-mb``, default 4x the
  L3 that sysfs reports, at most 2 GiB): what memory gives;
- ``set``: a buffer the size of the bytes one token reads (``--set-mb``, default the
  bundled SmolLM2 GGUF's ~100 MB), read over and over as a decode step reads its
  weights: what a step can get when part of its working set stays in the L3.

Both on 2 MiB pages as the step's weights are (kernels/huge_pages.py); ``--pages 4k``
for the small pages. `bench latency --roofline` runs the same probe in its own process,
before and after its decode runs, and prints the decode's GB/s against it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from fleetserve.kernels import library

# The bundled SmolLM2-135M Q4_1 GGUF: weights + the LM head one token reads, plus its KV.
DEFAULT_SET_MB = 100


@dataclass(frozen=True)
class Probe:
    """One probe: `size` ("dram" | "set"), its buffer's MB, threads, GB/s (wall: best and
    median pass; cpu: the best pass over its slowest thread's CPU time)."""

    size: str
    megabytes: float
    threads: int
    best_gbs: float
    median_gbs: float
    cpu_gbs: float


def _probe_fn() -> Any:
    lib = library.open_library()
    if lib is None:
        raise RuntimeError("the read probe needs the C kernel library (a C compiler)")
    fn = lib.read_probe
    fn.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int64
    return fn


def read_bandwidth(
    megabytes: float, threads: int, reps: int = 10, huge: bool = True, size: str = "set"
) -> Probe:
    """Streams `megabytes` (MB of 1e6 bytes) on `threads` threads `reps` times."""
    if megabytes <= 0 or threads < 1 or reps < 1:
        raise ValueError("megabytes must be > 0, threads and reps >= 1")
    best = (ctypes.c_double * 3)()
    n = _probe_fn()(int(megabytes * 1e6), threads, reps, int(huge), best)
    if n < 0:
        raise MemoryError(f"read probe: could not allocate {megabytes} MB")
    gbs = [n / s / 1e9 for s in best]
    return Probe(size, round(n / 1e6, 1), threads, *gbs)


def l3_bytes() -> int:
    """The largest cache sysfs reports for cpu0 (0 when it says nothing)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        try:
            with open(os.path.join(root, name, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best


def default_dram_mb() -> float:
    return min(4 * l3_bytes(), 2 << 30) / 1e6 or 1024.0


def probe_all(
    threads: list[int], set_mb: float, dram_mb: float | None, reps: int, huge: bool = True
) -> list[Probe]:
    """Each thread count at the working-set size, then (dram_mb not None) beyond the L3."""
    out = [read_bandwidth(set_mb, t, reps, huge, "set") for t in threads]
    if dram_mb:
        out += [read_bandwidth(dram_mb, t, max(3, reps // 3), huge, "dram") for t in threads]
    return out


def format_probes(probes: list[Probe]) -> str:
    return "\n".join(
        f"read probe {p.size} ({p.megabytes:.0f} MB), {p.threads} thread(s): best "
        f"{p.best_gbs:.1f} GB/s, median {p.median_gbs:.1f}; best on the CPU clock "
        f"{p.cpu_gbs:.1f}"
        for p in probes
    )


def bytes_per_token(engine: Any, mean_context: float) -> float | None:
    """Bytes one decode step of one stream reads: every projection's and the LM head's
    weights, and the KV cache at `mean_context` positions. None: no C step here."""
    try:
        plan = engine.core.executor.runner.model.model.decode_plan
    except AttributeError:  # another executor (ranks in other processes)
        return None
    if plan is None:
        return None
    return float(sum(plan.weight_bytes.values()) + plan.kv_bytes_per_position * mean_context)


def roofline_lines(
    tok_s: float, cpu_ms: float, token_mb: float, threads: int, probes: list[Probe]
) -> str:
    """tok/s x MB/token as GB/s against each probe of the same thread count: wall tok/s
    against the probe's best wall pass; at one thread also CPU ms/token against the
    probe's best CPU-clock pass (both leave out time spent preempted)."""
    gbs = tok_s * token_mb / 1e3
    mine = [p for p in probes if p.threads == threads]
    lines = [
        f"roofline: {tok_s:.1f} tok/s x {token_mb:.1f} MB/token = {gbs:.1f} GB/s; "
        + ", ".join(f"{gbs / p.best_gbs:.0%} of {p.size} {p.best_gbs:.1f}" for p in mine)
    ]
    if threads == 1 and cpu_ms > 0:
        cpu_gbs = token_mb / cpu_ms
        lines.append(
            f"roofline (CPU clock): {token_mb:.1f} MB / {cpu_ms:.2f} CPU ms = {cpu_gbs:.1f} "
            "GB/s; "
            + ", ".join(f"{cpu_gbs / p.cpu_gbs:.0%} of {p.size} {p.cpu_gbs:.1f}" for p in mine)
        )
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--set-mb", type=float, default=DEFAULT_SET_MB, help="working-set size")
    p.add_argument("--dram-mb", type=float, default=None, help="default: 4x L3, <= 2 GiB")
    p.add_argument("--no-dram", action="store_true", help="skip the beyond-L3 probe")
    p.add_argument("--reps", type=int, default=10, help="passes after a warm one")
    p.add_argument("--pages", choices=("2m", "4k"), default="2m")
    p.add_argument("--json", default=None, help="write the figures here")


def run(args: argparse.Namespace) -> int:
    threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    dram = None if args.no_dram else (args.dram_mb or default_dram_mb())
    probes = probe_all(threads, args.set_mb, dram, args.reps, args.pages == "2m")
    print(format_probes(probes))
    print(f"(L3 per sysfs: {l3_bytes() / 2**20:.0f} MiB; 1-minute load {os.getloadavg()[0]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(p) for p in probes], f, indent=1)
    return 0
