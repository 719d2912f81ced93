"""`fleetserve bench embed`: a tiny in-process run, and reading a server's batch histogram."""

from __future__ import annotations

import argparse
import asyncio
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from fleetserve.bench import embed as bench
from fleetserve.entrypoints.openai.protocol_embed import EmbeddingRequest
from fleetserve.entrypoints.openai.serving_embedding import create_embedding
from fleetserve.serve.microbatch.batcher import MicroBatchConfig
from fleetserve.serve.microbatch.services import EmbedService


def test_in_process_run_reports_both_runs_and_batches() -> None:
    p = argparse.ArgumentParser()
    bench.add_cli_args(p)
    args = p.parse_args(
        ["--num-inputs", "12", "--num-baseline-inputs", "3", "--concurrency", "6",
         "--max-batch-size", "4", "--batch-wait-timeout-s", "0.05"]
    )  # fmt: skip
    inputs = bench.make_inputs(12, 2, 6, seed=0)
    base, batched = asyncio.run(bench.run_in_process(args, inputs))
    assert (base.name, base.concurrency, base.num_inputs) == ("one-at-a-time", 1, 3)
    assert base.batch_sizes == {1: 3}
    assert (batched.concurrency, batched.num_inputs) == (6, 12)
    assert sum(size * n for size, n in batched.batch_sizes.items()) == 12
    assert max(batched.batch_sizes) > 1 and max(batched.batch_sizes) <= 4
    report = bench.format_results([base, batched])
    assert "speed-up:" in report and "batch sizes (batched)" in report


def test_against_a_server_reads_its_batch_histogram() -> None:
    """The --base-url path, on an in-process app that exposes the batch-size histogram the
    way the fleet server is meant to (`fleetserve:batch_size{model_name}`)."""
    registry = CollectorRegistry()
    hist = Histogram(
        "fleetserve:batch_size",
        "items per batch",
        ["model_name"],
        buckets=[1, 2, 4, 8, 16, 32],
        registry=registry,
    )
    service = EmbedService(
        "minilm",
        "all-MiniLM-L6-v2",
        batching=MicroBatchConfig(max_batch_size=4, batch_wait_timeout_s=0.05),
        on_batch=lambda n, s: hist.labels(model_name="minilm").observe(n),
    )
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, object]:
        return await create_embedding(service, EmbeddingRequest(**await request.json()))

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode())

    p = argparse.ArgumentParser()
    bench.add_cli_args(p)
    args = p.parse_args(["--num-inputs", "8", "--num-baseline-inputs", "2", "--concurrency", "4"])

    async def main() -> list[bench.RunResult]:
        await service.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await bench.run_with_client(client, args, bench.make_inputs(8, 2, 5, 0))

    base, batched = asyncio.run(main())
    assert base.batch_sizes == {1: 2} and base.num_inputs == 2
    # Bucket upper bounds: every batch of 2 lands in le=2, of 3-4 in le=4.
    assert sum(batched.batch_sizes.values()) >= 2 and batched.num_inputs == 8
    assert set(batched.batch_sizes) <= {1, 2, 4} and max(batched.batch_sizes) > 1


def test_histogram_scrape_turns_cumulative_buckets_into_counts() -> None:
    text = "\n".join(
        [
            "# TYPE fleetserve:batch_size histogram",
            'fleetserve:batch_size_bucket{le="1.0",model_name="minilm"} 2.0',
            'fleetserve:batch_size_bucket{le="8.0",model_name="minilm"} 5.0',
            'fleetserve:batch_size_bucket{le="32.0",model_name="minilm"} 9.0',
            'fleetserve:batch_size_bucket{le="+Inf",model_name="minilm"} 9.0',
            'fleetserve:batch_size_bucket{le="1.0",model_name="other"} 7.0',
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=text)

    async def main() -> dict[int, int]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return dict(await bench._scrape_batch_sizes(client, "minilm"))

    assert asyncio.run(main()) == {1: 2, 8: 3, 32: 4}
