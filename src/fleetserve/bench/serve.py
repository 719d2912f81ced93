"""`fleetserve bench serve`: load an OpenAI-compatible server and measure it from outside.

Requests arrive as a seeded Poisson process (`--request-rate`, or several rates with
`--sweep`) and/or under a cap on requests in flight (`--max-concurrency`). Every request
streams, so time to first token, inter-token latency and time per output token are seen
as a client sees them. The run ends by itself: each request has a deadline (`--timeout`)
and a failed request is counted, not fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from fleetserve.bench.serve_metrics import (
    RequestResult,
    engine_busy,
    format_summary,
    max_rate_under_slo,
    parse_engine_counters,
    plot_sweeps,
    summarize,
)

# Short common words: nearly all are one token (with their leading space) in BPE vocabularies,
# so a prompt of n words is close to n tokens; the server's usage reports the exact count.
_WORD_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high such"
)
_WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str
    max_tokens: int


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, no /v1")
    p.add_argument(
        "--model", default=None, help="model name to send (default: first of /v1/models)"
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=None, help="req/s, Poisson arrivals")
    p.add_argument("--sweep", default=None, help="comma-separated request rates, run in turn")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--dataset", default=None, help='JSONL of {"prompt": ..., "max_tokens": ...}')
    p.add_argument("--input-len", default="64:256", help="prompt words: N or LO:HI (synthetic)")
    p.add_argument("--output-len", default="32:64", help="max_tokens: N or LO:HI")
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send vLLM's ignore_eos (for servers that refuse it)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--num-warmups", type=int, default=1, help="untimed requests sent first")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="p99 TTFT bound for the sweep")
    p.add_argument("--label", default=None, help="name of this server in prints and plots")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--plot", default=None, help="PNG of latency against request rate")
    p.add_argument(
        "--compare-json",
        action="append",
        default=[],
        help="earlier --json output to draw on the same plot (repeatable)",
    )
    p.add_argument(
        "--plot-only",
        action="store_true",
        help="send nothing: draw the --compare-json files into --plot",
    )


def parse_range(text: str, name: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"{name} must be N or LO:HI with integers, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{name} must satisfy 1 <= LO <= HI, got {text!r}")
    return bounds


def synthetic_prompts(
    num: int, seed: int, input_len: tuple[int, int], output_len: tuple[int, int]
) -> list[BenchPrompt]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        out.append(BenchPrompt(" ".join(rng.choices(_WORDS, k=n_in)), n_out))
    return out


def load_dataset(path: str, num: int, output_len: tuple[int, int], seed: int) -> list[BenchPrompt]:
    """Lines of {"prompt": str, "max_tokens": int?}; a missing max_tokens is drawn from
    --output-len. Cycles through the file when it holds fewer than `num` lines."""
    rng = random.Random(seed)
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{i}: 'prompt' must be a string")
            n = row.get("max_tokens")
            n = rng.randint(*output_len) if n is None else n
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{path}:{i}: 'max_tokens' must be an integer >= 1, got {n!r}")
            rows.append(BenchPrompt(row["prompt"], n))
    if not rows:
        raise ValueError(f"--dataset {path} holds no prompts")
    return [rows[i % len(rows)] for i in range(num)]


def _body(args: argparse.Namespace, p: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": p.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": p.prompt}]
    else:
        body["prompt"] = p.prompt
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    text = ""
    for c in obj.get("choices") or []:
        text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


async def send_one(
    client: httpx.AsyncClient, args: argparse.Namespace, p: BenchPrompt
) -> RequestResult:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    expected = p.max_tokens if args.ignore_eos else None
    return await stream_completion(client, args.base_url + path, _body(args, p), expected)


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], expected: int | None
) -> RequestResult:
    """POSTs one streaming (chat) completion `body` to `url` and times it as a client sees
    it. A stream that ends without `data: [DONE]` (its server went away mid-answer) is a
    failed request, as is an error event inside it."""
    t0 = time.perf_counter()
    ttft: float | None = None
    last = t0
    gaps: list[float] = []
    num_chunks = 0
    usage: dict[str, Any] = {}
    texts: list[str] = []
    finish: str | None = None
    stream_id: str | None = None
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(0, 0, expected, error=f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return RequestResult(0, 0, expected, error=f"stream error: {obj['error']}")
                usage = obj.get("usage") or usage
                stream_id = obj.get("id") or stream_id
                for c in obj.get("choices") or []:
                    finish = c.get("finish_reason") or finish
                text = _chunk_text(obj)
                if text:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                    num_chunks += 1
                    texts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(0, 0, expected, error=f"{type(e).__name__}: {e}"[:200])
    e2e = time.perf_counter() - t0
    if not done:
        return RequestResult(0, 0, expected, error="the stream ended before data: [DONE]")
    if ttft is None:
        return RequestResult(0, 0, expected, error="no output text in the stream")
    return RequestResult(
        num_prompt_tokens=int(usage.get("prompt_tokens", 0)),
        num_output_tokens=int(usage.get("completion_tokens", num_chunks)),
        expected_output_tokens=expected,
        ttft_s=ttft,
        e2e_s=e2e,
        itl_s=gaps,
        text="".join(texts),
        finish_reason=finish,
        stream_id=stream_id,
    )


async def _deadline(coro: Any, timeout_s: float, expected: int | None) -> RequestResult:
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        return RequestResult(0, 0, expected, error=f"timeout after {timeout_s:g} s")


async def _engine_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """fleetserve's engine counters from the server's /metrics (None: not there)."""
    try:
        resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    return parse_engine_counters(resp.text) if resp.status_code == 200 else None


async def run_load(
    args: argparse.Namespace, prompts: list[BenchPrompt], rate: float, concurrency: int | None
) -> tuple[list[RequestResult], float, dict[str, float] | None]:
    """Send `prompts` with Poisson arrivals at `rate` (inf: all at once), at most
    `concurrency` in flight; returns the results in prompt order, the wall time and, from
    a fleetserve server, what its engine did meanwhile (serve_metrics.engine_busy)."""
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(prompts))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:

        async def one(p: BenchPrompt) -> RequestResult:
            expected = p.max_tokens if args.ignore_eos else None
            if gate is None:
                return await _deadline(send_one(client, args, p), args.timeout, expected)
            async with gate:
                return await _deadline(send_one(client, args, p), args.timeout, expected)

        for p in prompts[: args.num_warmups]:
            await one(p)
        before = await _engine_counters(client, args.base_url)
        tasks = []
        t0 = time.perf_counter()
        arrival = 0.0  # seconds after t0; absolute, so event-loop delays do not accumulate
        for i, p in enumerate(prompts):
            if i and math.isfinite(rate):
                arrival += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(one(p)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        after = await _engine_counters(client, args.base_url) if before is not None else None
        return results, duration, engine_busy(before, after, duration)


def _resolve_model(args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def _rates(args: argparse.Namespace) -> list[float]:
    if args.sweep:
        try:
            rates = [float(r) for r in args.sweep.split(",") if r.strip()]
        except ValueError:
            raise ValueError(
                f"--sweep must be comma-separated numbers, got {args.sweep!r}"
            ) from None
    elif args.request_rate is not None:
        rates = [args.request_rate]
    elif args.max_concurrency is not None:
        rates = [math.inf]
    else:
        raise ValueError("give --request-rate, --sweep or --max-concurrency")
    if any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0, got {rates}")
    return rates


def _load_reports(paths: list[str]) -> list[dict[str, Any]]:
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def run(args: argparse.Namespace) -> int:
    if args.plot_only:
        if not args.plot or not args.compare_json:
            raise ValueError("--plot-only needs --plot and at least one --compare-json")
        plot_sweeps(_load_reports(args.compare_json), args.plot)
        print(f"plot written to {args.plot}", flush=True)
        return 0
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    rates = _rates(args)
    args.base_url = args.base_url.rstrip("/")
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    output_len = parse_range(args.output_len, "--output-len")
    if args.dataset:
        prompts = load_dataset(args.dataset, args.num_prompts, output_len, args.seed)
    else:
        input_len = parse_range(args.input_len, "--input-len")
        prompts = synthetic_prompts(args.num_prompts, args.seed, input_len, output_len)
    args.model = args.model or _resolve_model(args)
    label = args.label or args.model
    report: dict[str, Any] = {
        "label": label,
        "base_url": args.base_url,
        "model": args.model,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "input_len": None if args.dataset else args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "max_concurrency": args.max_concurrency,
        "runs": [],
    }
    for rate in rates:
        load_before = os.getloadavg()[0]
        results, duration, busy = asyncio.run(run_load(args, prompts, rate, args.max_concurrency))
        summary = summarize(results, duration)
        summary.update(
            engine=busy,
            request_rate=rate if math.isfinite(rate) else None,
            load_avg_1m_before=load_before,
            load_avg_1m_after=os.getloadavg()[0],
        )
        report["runs"].append(summary)
        cap = f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""
        print(format_summary(summary, f"{label}: request rate {rate:g}/s{cap}"), flush=True)
        print(
            f"load average (1 min): {load_before:.2f} before, "
            f"{summary['load_avg_1m_after']:.2f} after",
            flush=True,
        )
    if len(rates) > 1:
        report["max_rate_under_slo"] = max_rate_under_slo(report["runs"], args.ttft_slo)
        print(
            f"{label}: highest swept rate with p99 TTFT < {args.ttft_slo:g} s and no errors: "
            f"{report['max_rate_under_slo']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot_sweeps([report, *_load_reports(args.compare_json)], args.plot)
        print(f"plot written to {args.plot}", flush=True)
    return 0
