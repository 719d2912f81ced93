"""`fleetserve bench embed`: a tiny in-process run, and reading a server's batch histogram."""

from __future__ import annotations

import argparse
import asyncio
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import httpx

from fleetserve.bench import embed as bench


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
