"""`fleetserve bench embed`: what dynamic batching buys an embedding model.

Closed-loop clients each send one input per request, the next as soon as the last
returns. Two runs on the same inputs, one after the other:
- one-at-a-time: 1 client, and no batching (max_batch_size 1, so no wait for batch-mates);
- batched: `--concurrency` clients (64) with the dynamic batcher (`--max-batch-size`,
  `--batch-wait-timeout-s`).
It prints inputs/s, latency percentiles and the batch-size histogram of each run.

In-process (default) it starts two EmbedServices on `--model-path`; with `--base-url` it
sends POST /v1/embeddings to a running server instead (batching as that server is
configured; the histogram is read from its /metrics when it exposes one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace

import httpx

_TEXT = [
    "serving",
    "many",
    "models",
    "behind",
    "one",
    "endpoint",
    "means",
    "queues",
    "with",
    "their",
    "own",
    "deadlines",
    "and",
    "batches",
    "shaped",
    "to",
    "each",
    "kind",
    "of",
    "model",
    "an",
    "embedding",
    "model",
    "reads",
    "a",
    "whole",
    "sentence",
    "at",
    "once",
    "so",
    "requests",
    "that",
    "arrive",
    "close",
    "together",
    "can",
    "share",
    "one",
    "forward",
    "pass",
    "the",
    "batcher",
    "waits",
    "a",
    "few",
    "milliseconds",
    "for",
    "company",
    "and",
    "then",
    "runs",
    "what",
    "it",
    "has",
    "the",
    "cost",
    "of",
    "waiting",
    "is",
    "latency",
    "and",
    "the",
    "reward",
    "is",
    "throughput",
    "when",
    "many",
    "clients",
    "are",
    "active",
    "at",
    "the",
    "same",
    "time",
]


@dataclass(frozen=True)
class RunResult:
    name: str
    concurrency: int
    num_inputs: int
    seconds: float
    inputs_per_s: float
    p50_ms: float
    p99_ms: float
    batch_sizes: dict[int, int]  # batch size -> number of batches (empty if not known)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="a running server (default: in-process)")
    p.add_argument("--model", default="minilm", help="model name to send with --base-url")
    p.add_argument("--model-path", default="all-MiniLM-L6-v2", help="in-process model")
    p.add_argument("--num-inputs", type=int, default=512, help="inputs in the batched run")
    p.add_argument(
        "--num-baseline-inputs", type=int, default=128, help="inputs in the one-at-a-time run"
    )
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-timeout-s", type=float, default=0.01)
    p.add_argument("--min-words", type=int, default=6)
    p.add_argument("--max-words", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads in-process (1 is steadiest on a shared machine)",
    )
    p.add_argument(
        "--compare",
        choices=["sentence-transformers"],
        default=None,
        help="also time sentence-transformers' encode() on the same inputs (in-process "
        "only): one input per call, and batches of --max-batch-size, no server around it",
    )
    p.add_argument("--json", default=None, help="also write the results to this file")


def make_inputs(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_TEXT) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(n)
    ]


async def closed_loop(
    name: str, send: Callable[[str], Awaitable[None]], inputs: list[str], concurrency: int
) -> tuple[float, list[float]]:
    """Seconds for all inputs and each request's latency."""
    pending = iter(inputs)
    latencies: list[float] = []

    async def client() -> None:
        for text in pending:
            t0 = time.perf_counter()
            await send(text)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


def summarize(
    name: str, concurrency: int, seconds: float, latencies: list[float], sizes: Counter[int]
) -> RunResult:
    lat = sorted(latencies)

    def pct(q: float) -> float:
        return 1000 * lat[min(len(lat) - 1, int(q * len(lat)))]

    return RunResult(
        name,
        concurrency,
        len(lat),
        round(seconds, 3),
        round(len(lat) / seconds, 1),
        round(pct(0.5), 1),
        round(pct(0.99), 1),
        dict(sorted(sizes.items())),
    )


async def run_in_process(args: argparse.Namespace, inputs: list[str]) -> list[RunResult]:
    from fleetserve.serve.microbatch.batcher import MicroBatchConfig
    from fleetserve.serve.microbatch.services import EmbedService

    results = []
    plans = [
        ("one-at-a-time", 1, MicroBatchConfig(1, 0.0), inputs[: args.num_baseline_inputs]),
        (
            "batched",
            args.concurrency,
            MicroBatchConfig(args.max_batch_size, args.batch_wait_timeout_s, 100_000),
            inputs,
        ),
    ]
    for name, concurrency, batching, run_inputs in plans:
        sizes: Counter[int] = Counter()
        service = EmbedService(
            name, args.model_path, batching=batching, on_batch=_count_into(sizes)
        )
        await service.start()

        async def send(text: str, service: EmbedService = service) -> None:
            await service.embed([text])

        await closed_loop(name, send, run_inputs[:4], 1)  # warm-up, not counted
        sizes.clear()
        seconds, lat = await closed_loop(name, send, run_inputs, concurrency)
        await service.shutdown()
        results.append(summarize(name, concurrency, seconds, lat, sizes))
    return results


def run_sentence_transformers(args: argparse.Namespace, inputs: list[str]) -> list[RunResult]:
    """The peer: sentence-transformers' own encode(), offline, one input per call and
    then batches (its latency columns are per call, i.e. per batch for the batched run)."""
    from sentence_transformers import SentenceTransformer

    from fleetserve.engine.embedding import resolve_embedding_model

    st = SentenceTransformer(resolve_embedding_model(args.model_path), device="cpu")
    results = []
    for name, size, run_inputs in (
        ("st one-at-a-time", 1, inputs[: args.num_baseline_inputs]),
        (f"st batch={args.max_batch_size}", args.max_batch_size, inputs),
    ):
        st.encode(run_inputs[:4], batch_size=size)  # warm-up
        calls = [run_inputs[i : i + size] for i in range(0, len(run_inputs), size)]
        latencies = []
        start = time.perf_counter()
        for call in calls:
            t0 = time.perf_counter()
            st.encode(call, batch_size=size, convert_to_numpy=True)
            latencies.append(time.perf_counter() - t0)
        seconds = time.perf_counter() - start
        r = summarize(name, 1, seconds, latencies, Counter({size: len(calls)}))
        # summarize counted calls; a batched call carries `size` inputs.
        results.append(
            replace(r, num_inputs=len(run_inputs), inputs_per_s=round(len(run_inputs) / seconds, 1))
        )
    return results


def _count_into(sizes: Counter[int]) -> Callable[[int, float], None]:
    def on_batch(batch_size: int, seconds: float) -> None:
        sizes[batch_size] += 1

    return on_batch


async def run_against_server(args: argparse.Namespace, inputs: list[str]) -> list[RunResult]:
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        return await run_with_client(client, args, inputs)


async def run_with_client(
    client: httpx.AsyncClient, args: argparse.Namespace, inputs: list[str]
) -> list[RunResult]:
    """Both runs through `client` (its base_url is the server root)."""

    async def send(text: str) -> None:
        r = await client.post("/v1/embeddings", json={"model": args.model, "input": text})
        r.raise_for_status()

    results = []
    for name, concurrency, run_inputs in (
        ("one-at-a-time", 1, inputs[: args.num_baseline_inputs]),
        ("batched", args.concurrency, inputs),
    ):
        await closed_loop(name, send, run_inputs[:4], 1)
        before = await _scrape_batch_sizes(client, args.model)
        seconds, lat = await closed_loop(name, send, run_inputs, concurrency)
        after = await _scrape_batch_sizes(client, args.model)
        sizes = Counter({k: after[k] - before.get(k, 0) for k in after})
        results.append(summarize(name, concurrency, seconds, lat, +sizes))
    return results


async def _scrape_batch_sizes(client: httpx.AsyncClient, model: str) -> Counter[int]:
    """Batches per histogram bucket (upper bound) of a `*batch_size*` histogram of `model`."""
    r = await client.get("/metrics")
    if r.status_code != 200:
        return Counter()
    cumulative: dict[int, float] = {}
    pattern = re.compile(r"^\S*batch_size\S*_bucket\{(.*)\} (\S+)$")
    for line in r.text.splitlines():
        m = pattern.match(line)
        if not m or f'model_name="{model}"' not in m.group(1):
            continue
        le = re.search(r'le="([^"]+)"', m.group(1))
        if le and le.group(1) != "+Inf":
            cumulative[int(float(le.group(1)))] = float(m.group(2))
    counts: Counter[int] = Counter()
    below = 0.0
    for bound in sorted(cumulative):
        counts[bound] = int(cumulative[bound] - below)
        below = cumulative[bound]
    return counts


def format_results(results: list[RunResult]) -> str:
    lines = [
        f"{'run':<16} {'clients':>7} {'inputs':>6} {'seconds':>8} {'inputs/s':>9} "
        f"{'p50 ms':>8} {'p99 ms':>8}"
    ]
    for r in results:
        lines.append(
            f"{r.name:<16} {r.concurrency:>7} {r.num_inputs:>6} {r.seconds:>8.2f} "
            f"{r.inputs_per_s:>9.1f} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f}"
        )
    for r in results:
        if r.batch_sizes:
            hist = ", ".join(f"{size}: {n}" for size, n in r.batch_sizes.items())
            lines.append(f"batch sizes ({r.name}), size: batches -> {hist}")
    by_name = {r.name: r for r in results}
    if "one-at-a-time" in by_name and "batched" in by_name:
        gain = by_name["batched"].inputs_per_s / by_name["one-at-a-time"].inputs_per_s
        lines.append(f"speed-up: {gain:.2f}x")
    st = [r for r in results if r.name.startswith("st ")]
    if len(st) == 2:
        lines.append(
            f"sentence-transformers speed-up: {st[1].inputs_per_s / st[0].inputs_per_s:.2f}x"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.num_inputs < 1 or args.num_baseline_inputs < 1:
        raise ValueError("concurrency, num_inputs and num_baseline_inputs must be >= 1")
    if not 1 <= args.min_words <= args.max_words:
        raise ValueError("min_words must be in [1, max_words]")
    inputs = make_inputs(
        max(args.num_inputs, args.num_baseline_inputs), args.min_words, args.max_words, args.seed
    )
    if not args.base_url:
        import torch

        torch.set_num_threads(args.num_threads)
    runner = run_against_server if args.base_url else run_in_process
    results = asyncio.run(runner(args, inputs))
    if args.compare == "sentence-transformers":
        if args.base_url:
            raise ValueError("--compare sentence-transformers runs in-process only")
        results += run_sentence_transformers(args, inputs)
    print(format_results(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0
