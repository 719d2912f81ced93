"""`fleetserve bench serve` against a real fleetserve server on a tiny random model."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetserve.bench.serve import load_dataset, parse_range, synthetic_prompts
from fleetserve.bench.serve_metrics import (
    PERCENTILES,
    RequestResult,
    engine_busy,
    format_summary,
    max_rate_under_slo,
    parse_engine_counters,
    percentile,
    summarize,
)
from fleetserve.entrypoints.cli import main

sys.path.insert(0, str(Path(__file__).parent / "server"))
from server_proc import ServerProc  # noqa: E402

NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def server(tiny_llama: str) -> Iterator[ServerProc]:
    srv = ServerProc(tiny_llama, "--served-model-name", "tiny", "--max-num-seqs", "16")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _bench(server: ServerProc, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    argv = [
        "bench", "serve", "--base-url", server.url, "--num-prompts", str(NUM_PROMPTS),
        "--input-len", "8:24", "--output-len", "4:12", "--timeout", "60", "--json", str(out),
        *extra,
    ]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def _check_sane(run: dict) -> None:
    assert run["num_completed"] == NUM_PROMPTS and run["num_errors"] == 0, run["errors"]
    # ignore_eos: every request produced exactly its max_tokens.
    assert run["num_output_mismatch"] == 0
    expected = sum(p.max_tokens for p in synthetic_prompts(NUM_PROMPTS, 0, (8, 24), (4, 12)))
    assert run["total_output_tokens"] == expected
    assert run["total_prompt_tokens"] >= NUM_PROMPTS * 8
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        values = [run[key][f"p{q}"] for q in PERCENTILES]
        assert all(v > 0 for v in values), (key, values)
        assert values == sorted(values), (key, values)
    assert run["ttft_s"]["p99"] <= run["e2e_s"]["p99"]
    assert run["ttft_s"]["mean"] <= run["e2e_s"]["mean"]
    assert run["request_throughput"] > 0 and run["output_throughput"] > 0
    # What the engine did in the run, from the server's /metrics before and after it.
    busy = run["engine"]
    assert busy is not None and busy["num_steps"] >= 12  # the longest answer's decodes
    assert 0 < busy["busy_fraction"] <= 1.05  # its steps' wall time inside the run's
    step_tokens = busy["tokens_per_step"] * busy["num_steps"]
    fed = run["total_prompt_tokens"] + run["total_output_tokens"]
    assert run["total_output_tokens"] - NUM_PROMPTS - 1e-6 <= step_tokens <= fed + 1e-6


def test_poisson_rate_completions(server: ServerProc, tmp_path: Path) -> None:
    report = _bench(server, tmp_path, "--request-rate", "4", "--label", "fs")
    assert report["model"] == "tiny" and report["label"] == "fs"
    (run,) = report["runs"]
    assert run["request_rate"] == 4
    _check_sane(run)


def test_max_concurrency_chat(server: ServerProc, tmp_path: Path) -> None:
    report = _bench(server, tmp_path, "--max-concurrency", "3", "--endpoint", "chat")
    (run,) = report["runs"]
    assert run["request_rate"] is None and report["max_concurrency"] == 3
    _check_sane(run)


def test_sweep_and_plot(server: ServerProc, tmp_path: Path) -> None:
    plot = tmp_path / "latency.png"
    report = _bench(server, tmp_path, "--sweep", "2,8", "--ttft-slo", "30", "--plot", str(plot))
    assert [r["request_rate"] for r in report["runs"]] == [2, 8]
    for run in report["runs"]:
        _check_sane(run)
    assert report["max_rate_under_slo"] == 8
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Redraw from the saved figures alone (how two servers' sweeps share one plot).
    redraw = tmp_path / "redraw.png"
    saved = str(tmp_path / "bench.json")
    argv = ["bench", "serve", "--plot-only", "--plot", str(redraw), "--compare-json", saved]
    assert main(argv) == 0
    assert redraw.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dataset_and_errors_counted(server: ServerProc, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n{"prompt": "a b c"}\n')
    report = _bench(server, tmp_path, "--request-rate", "8", "--dataset", str(data))
    _check_run = report["runs"][0]
    assert _check_run["num_errors"] == 0 and _check_run["num_output_mismatch"] == 0
    # A model the server does not serve: every request fails, the run still ends cleanly.
    report = _bench(server, tmp_path, "--request-rate", "8", "--model", "nope")
    run = report["runs"][0]
    assert run["num_errors"] == NUM_PROMPTS and run["num_completed"] == 0
    assert any("404" in e or "400" in e for e in run["errors"]), run["errors"]


def test_percentile_and_summary_units() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    ok = RequestResult(10, 5, 5, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.1, 0.1, 0.1])
    assert ok.tpot_s == pytest.approx(0.1)
    bad = RequestResult(0, 0, 5, error="timeout after 1 s")
    s = summarize([ok, bad], duration_s=2.0)
    assert s["num_completed"] == 1 and s["num_errors"] == 1 and s["errors"] == [bad.error]
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 2.5
    runs = [
        {"request_rate": 1.0, "num_errors": 0, "ttft_s": {"p99": 0.5}},
        {"request_rate": 2.0, "num_errors": 0, "ttft_s": {"p99": 2.5}},
        {"request_rate": 3.0, "num_errors": 1, "ttft_s": {"p99": 0.5}},
    ]
    assert max_rate_under_slo(runs, 2.0) == 1.0
    assert max_rate_under_slo(runs[1:], 2.0) is None


def test_engine_counters_from_metrics_page() -> None:
    """fleetserve's engine counters summed over models; a page without them (another
    server's) gives None, and so no engine line."""
    page = "\n".join([
        "# TYPE fleetserve:num_steps_total counter",
        'fleetserve:num_steps_total{model_name="a"} 10.0',
        'fleetserve:num_steps_total{model_name="b"} 5.0',
        'fleetserve:step_seconds_total{model_name="a"} 1.5',
        'fleetserve:num_step_tokens_total{model_name="a"} 300.0',
        'fleetserve:num_steps_created{model_name="a"} 1.7e9',
        'vllm:num_steps_total{model_name="a"} 99.0',
    ])  # fmt: skip
    before = parse_engine_counters(page)
    assert before == {"num_steps": 15.0, "step_seconds": 1.5, "num_step_tokens": 300.0}
    assert parse_engine_counters('vllm:num_requests_running{model_name="a"} 1.0') is None
    after = {"num_steps": 25.0, "step_seconds": 3.5, "num_step_tokens": 700.0}
    busy = engine_busy(before, after, 4.0)
    assert busy == {
        "num_steps": 10.0, "step_seconds": 2.0, "busy_fraction": 0.5,
        "ms_per_step": 200.0, "tokens_per_step": 40.0,
    }  # fmt: skip
    assert engine_busy(None, after, 4.0) is None
    summary = summarize([RequestResult(5, 3, None, 0.1, 0.5, [0.2, 0.2])], 4.0)
    assert "engine:" not in format_summary(summary, "peer")
    summary["engine"] = busy
    line = format_summary(summary, "fs").splitlines()[-1]
    assert (
        line
        == "engine: 10 steps, busy 2.00 s of the 4.00 s (50.0%), 200.0 ms and 40.0 tokens a step"
    )


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--input-len"):
        parse_range("9:3", "--input-len")
    with pytest.raises(ValueError, match="--output-len"):
        parse_range("x", "--output-len")
    assert parse_range("7", "--output-len") == (7, 7)
    assert main(["bench", "serve", "--num-prompts", "2"]) == 2  # no rate, no concurrency
    assert main(["bench", "serve", "--sweep", "1,0", "--num-prompts", "2"]) == 2


def test_dataset_rejects_bad_lines(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        load_dataset(str(data), 2, (4, 8), 0)


def test_ray_hf_baseline_replica_streams(tiny_llama: str) -> None:
    """The baseline's replica logic, without Ray: SSE chunks, one per token, then usage."""
    pytest.importorskip("ray")
    import asyncio

    from fleetserve.bench.ray_hf_baseline import HFCompletions, _params

    replica = HFCompletions(tiny_llama, "tiny", num_threads=1)
    body = {
        "prompt": "hello world",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def collect() -> list[str]:
        stream = await replica.complete(body)
        assert not isinstance(stream, dict)
        return [event async for event in stream]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:6]] == [None] * 5 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    full = asyncio.run(replica.complete({**body, "stream": False}))
    assert isinstance(full, dict) and full["usage"]["completion_tokens"] == 5
    assert full["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in chunks[:-1])
    with pytest.raises(ValueError, match="max_tokens"):
        _params({"prompt": "x", "max_tokens": 0})
