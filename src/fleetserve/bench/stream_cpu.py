"""`fleetserve bench stream-cpu`: the server process's CPU time per streamed token.

Starts `fleetserve serve` on 127.0.0.1 (a tiny random-weight llama made for the run
unless `--model` is given; one engine thread), streams one chat completion at a time
with logprobs (top 2) and EOS ignored, and reads the API process's CPU time (user +
system; the engine-core process it starts is not counted) before and after each
sample: as many streams of one length as make `--sample-tokens` tokens (the clock ticks
every 10 ms, so a sample must be long). The figure, CPU ms per streamed token, is the
median of `--repeats` samples after one warm-up, for each answer length of `--tokens`:
flat across lengths means no hop of the stream does work that grows with the answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import psutil

from fleetserve.bench.local_server import LocalServer, free_port


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: a tiny llama made for the run")
    p.add_argument("--tokens", default="300,3000", help="answer lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per length")
    p.add_argument("--sample-tokens", type=int, default=6000, help="tokens per sample")
    p.add_argument("--top-logprobs", type=int, default=2)
    p.add_argument("--json", default=None, help="write the figures here")


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _stream(url: str, num_tokens: int, top_logprobs: int) -> int:
    """Streams one chat completion; returns the completion tokens its usage reports."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": num_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": top_logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    used = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
    return used


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.tokens.split(",")]
    with tempfile.TemporaryDirectory(prefix="fleetserve-stream-cpu-") as tmp:
        model = args.model
        if model is None:
            from fleetserve.models.make_model import make_model

            model = make_model(tmp, "llama", "tiny", max_position_embeddings=max(lengths) + 256)
        port = free_port()
        cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "serve", "--model", model,
               "--served-model-name", "m", "--port", str(port), "--num-threads", "1",
               "--max-model-len", str(max(lengths) + 128)]  # fmt: skip
        server = LocalServer(cmd, port, name="stream-cpu").wait_ready(300)
        try:
            api = psutil.Process(server.proc.pid)
            _stream(server.url, 32, args.top_logprobs)  # warm-up
            figures: list[dict[str, Any]] = []
            for n in lengths:
                per_token = []
                num_streams = max(1, args.sample_tokens // n)
                for _ in range(args.repeats):
                    c0, t0 = _cpu_s(api), time.perf_counter()
                    for _ in range(num_streams):
                        got = _stream(server.url, n, args.top_logprobs)
                        assert got == n, f"asked for {n} tokens, got {got}"
                    c1, t1 = _cpu_s(api), time.perf_counter()
                    per_token.append((c1 - c0) / (n * num_streams) * 1e3)
                figures.append({
                    "tokens": n,
                    "cpu_ms_per_token": round(statistics.median(per_token), 4),
                    "runs_ms_per_token": [round(x, 4) for x in per_token],
                    "streams_per_sample": num_streams,
                    "last_sample_wall_s": round(t1 - t0, 2),
                })  # fmt: skip
                print(json.dumps(figures[-1]), flush=True)
        finally:
            server.stop()
    ratio = figures[-1]["cpu_ms_per_token"] / figures[0]["cpu_ms_per_token"]
    result = {"top_logprobs": args.top_logprobs, "figures": figures,
              f"ratio_{lengths[-1]}_to_{lengths[0]}": round(ratio, 3)}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
