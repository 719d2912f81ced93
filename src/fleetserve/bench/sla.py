"""`fleetserve bench sla`: what SLA classes buy an interactive user during a batch flood.

Against one running server, the phases `--phases` names, in its order (default
`one-class,classes`):
- `idle`: the `--probes` short streaming completions alone, one after another, as
  `--probe-class`: the interactive TTFT without any batch load, the baseline;
- `one-class`: a flood of `--flood` long streaming completions, then the probes sent one
  after another while the flood runs, all in the same class (`--flat-class`, default:
  the server's default class);
- `classes`: the same, with the flood sent as `--flood-class` (e.g. batch) and the
  probes as `--probe-class` (e.g. interactive), through the `X-Fleetserve-Class` header.
Reported per phase: the probes' time to first token (p50, p99, max) and the flood's
completed count and duration. The server needs both classes in its fleet config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

PHASES = ("idle", "one-class", "classes")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, no /v1")
    p.add_argument("--model", required=True, help="a generate model of the fleet")
    p.add_argument("--flood", type=int, default=32, help="batch requests sent at once")
    p.add_argument("--flood-max-tokens", type=int, default=128)
    p.add_argument("--probes", type=int, default=20, help="interactive requests, one at a time")
    p.add_argument("--probe-max-tokens", type=int, default=4)
    p.add_argument("--probe-gap", type=float, default=0.2, help="seconds between probes")
    p.add_argument("--flood-class", default="batch")
    p.add_argument("--probe-class", default="interactive")
    p.add_argument("--flat-class", default=None, help="phase 1's class (default: the server's)")
    p.add_argument(
        "--phases",
        default="one-class,classes",
        help=f"comma-separated, run in this order; of: {', '.join(PHASES)}",
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write the figures here")


@dataclass(frozen=True)
class PhaseResult:
    phase: str
    probe_ttft_p50_s: float
    probe_ttft_p99_s: float
    probe_ttft_max_s: float
    num_probes_ok: int
    num_flood_ok: int
    num_flood_failed: int
    flood_duration_s: float


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


async def _stream(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, cls: str | None
) -> tuple[float, float] | None:
    """Streams one completion; returns its time to first token and its end (perf_counter),
    or None if it failed."""
    headers = {"X-Fleetserve-Class": cls} if cls else {}
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if '"error"' in line:
                return None
            if first is None:
                first = time.perf_counter() - start
    return None if first is None else (first, time.perf_counter())


async def run_phase(
    args: argparse.Namespace,
    phase: str,
    flood_cls: str | None,
    probe_cls: str | None,
    num_flood: int,
) -> PhaseResult:
    limits = httpx.Limits(max_connections=num_flood + 8)
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=args.timeout, limits=limits
    ) as client:
        t0 = time.perf_counter()
        flood = [
            asyncio.ensure_future(
                _stream(client, args.model, f"batch job {i}: the", args.flood_max_tokens, flood_cls)
            )
            for i in range(num_flood)
        ]
        if flood:
            await asyncio.sleep(1.0)  # the flood is in: the batch is full, the rest queued
        ttfts: list[float] = []
        for i in range(args.probes):
            probe = await _stream(client, args.model, f"hi {i}", args.probe_max_tokens, probe_cls)
            if probe is not None:
                ttfts.append(probe[0])
            await asyncio.sleep(args.probe_gap)
        results = await asyncio.gather(*flood)
    ok = [r for r in results if r is not None]
    duration = max((end for _, end in ok), default=t0) - t0  # the flood's own end
    nan = float("nan")
    return PhaseResult(
        phase,
        percentile(ttfts, 50) if ttfts else nan,
        percentile(ttfts, 99) if ttfts else nan,
        max(ttfts) if ttfts else nan,
        len(ttfts),
        len(ok),
        len(results) - len(ok),
        duration,
    )


def parse_phases(text: str) -> list[str]:
    phases = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise ValueError(f"--phases: {', '.join(bad) or 'none given'}; choose from {PHASES}")
    return phases


def run(args: argparse.Namespace) -> int:
    if args.flood < 1 or args.probes < 1:
        raise ValueError("--flood and --probes must be >= 1")
    phases = parse_phases(args.phases)

    async def main() -> list[PhaseResult]:
        results = []
        for phase in phases:
            if phase == "idle":
                res = await run_phase(args, phase, None, args.probe_class, 0)
            elif phase == "one-class":
                res = await run_phase(args, phase, args.flat_class, args.flat_class, args.flood)
            else:
                res = await run_phase(args, phase, args.flood_class, args.probe_class, args.flood)
            results.append(res)
        return results

    results = asyncio.run(main())
    print(
        f"{'phase':<10} {'probe TTFT p50':>15} {'p99':>8} {'max':>8} {'probes':>7} "
        f"{'flood ok':>9} {'failed':>7} {'flood s':>8}"
    )
    for r in results:
        print(
            f"{r.phase:<10} {r.probe_ttft_p50_s:>14.3f}s {r.probe_ttft_p99_s:>7.3f}s "
            f"{r.probe_ttft_max_s:>7.3f}s {r.num_probes_ok:>7} {r.num_flood_ok:>9} "
            f"{r.num_flood_failed:>7} {r.flood_duration_s:>7.1f}s"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0
