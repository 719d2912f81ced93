"""`fleetserve bench structured --compare fleetserve vllm llamacpp`: the same chat requests
with and without a JSON schema, served, against vLLM's CPU build and llama.cpp's server.

Each server is started on 127.0.0.1 (a free port), all at once, and measured in turn from
outside with one streaming client (bench/serve.py's `stream_completion`):

    1 stream    `--serial` requests one after another: TPOT (e2e - TTFT) / (tokens - 1)
    N streams   N requests at once (`--streams`): output tokens / wall time, and TPOT

Free requests send `ignore_eos` and run to `--max-tokens`; constrained ones send
`response_format: {"type": "json_schema", ...}` (the order schema of bench/structured.py)
and ask for a large order, so nearly all are cut by `--max-tokens` too: both kinds
produce about the same number of tokens (reported). Every constrained answer is checked:
one that finished (`stop`) must validate against the schema, one cut by the length must
at least start with `{` (a server that ignored the schema shows there).

Rounds alternate servers and kinds (server A free, A schema, B free, B schema, ...), so a
shared machine's load hits all alike; the medians of the rounds are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from fleetserve.bench.local_server import (
    LocalServer,
    fleetserve_serve_cmd,
    free_port,
    vllm_cpu_env,
    vllm_serve_cmd,
)
from fleetserve.bench.serve import stream_completion
from fleetserve.bench.serve_metrics import RequestResult
from fleetserve.bench.structured import ORDER_SCHEMA

PEERS = ("fleetserve", "vllm", "llamacpp")
KINDS = ("free", "json_schema")
PROMPT = (
    "Write the JSON of a large order (number {i}) with at least fifteen items for a hardware store."
)


@dataclass(frozen=True)
class Peer:
    name: str
    server: LocalServer
    model: str  # the model name it answers to


def response_format() -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True},
    }


def request_body(model: str, i: int, kind: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT.format(i=i)}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "free":
        body["ignore_eos"] = True
    else:
        body["response_format"] = response_format()
    return body


def check_answer(r: RequestResult) -> str:
    """ "valid" (a finished answer that validates), "prefix" (cut by the length, starts
    like the schema's object), or "bad"."""
    import jsonschema

    text = r.text.strip()
    if r.finish_reason == "length":
        return "prefix" if text.startswith("{") else "bad"
    try:
        jsonschema.validate(json.loads(text), ORDER_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return "bad"
    return "valid"


async def _run(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(body: dict[str, Any]) -> RequestResult:
            async with gate:
                return await stream_completion(client, url, body, None)

        t0 = time.perf_counter()
        results = list(await asyncio.gather(*(one(b) for b in bodies)))
        return results, time.perf_counter() - t0


def measure(
    peer: Peer, kind: str, streams: int, num: int, max_tokens: int, offset: int
) -> dict[str, Any]:
    """`num` requests, at most `streams` in flight; prompts numbered from `offset` (a new
    number per request, so no server answers from its prefix cache beyond the template)."""
    bodies = [request_body(peer.model, offset + i, kind, max_tokens) for i in range(num)]
    load = os.getloadavg()[0]
    cpu0 = server_cpu_s(peer.server)
    results, wall = asyncio.run(_run(peer.server.url + "/v1/chat/completions", bodies, streams))
    cpu = server_cpu_s(peer.server) - cpu0
    ok = [r for r in results if r.ok]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    tokens = sum(r.num_output_tokens for r in ok)
    checks = [check_answer(r) for r in ok] if kind != "free" else []
    return {
        "errors": [r.error for r in results if not r.ok][:3],
        "tpot_ms": 1e3 * statistics.mean(tpots) if tpots else float("nan"),
        "ttft_ms": 1e3 * statistics.mean(r.ttft_s for r in ok if r.ttft_s is not None)
        if ok
        else float("nan"),
        "tok_s": tokens / wall,
        # The server's CPU time (all its processes and threads) per output token: less
        # swayed by other processes' load than wall time (spinning threads count too).
        "cpu_ms_per_token": 1e3 * cpu / max(1, tokens),
        "tokens_per_request": tokens / max(1, len(ok)),
        "valid": checks.count("valid"),
        "prefix": checks.count("prefix"),
        "bad": checks.count("bad"),
        "load_1m": load,
    }


def server_cpu_s(server: LocalServer) -> float:
    """User + system CPU seconds of the server process and its descendants so far."""
    import psutil

    total = 0.0
    for proc in [psutil.Process(server.proc.pid), *server.descendants()]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def start_peers(args: argparse.Namespace) -> list[Peer]:
    """Starts every server of --compare; on any failure (or Ctrl-C) stops those started."""
    peers: list[Peer] = []
    started: list[LocalServer] = []
    try:
        for name in args.compare:
            port = free_port()
            if name == "fleetserve":
                server = _fleetserve(args, port)
            elif name == "vllm":
                server = _vllm(args, port)
            else:
                server = _llamacpp(args, port)
            started.append(server)
            print(f"{name}: starting on {server.url} (log {server.log.name})", flush=True)
            server.wait_ready(args.startup_timeout)
            model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            peers.append(Peer(name, server, model))
    except BaseException:
        for s in started:
            s.stop()
        raise
    return peers


def _fleetserve(args: argparse.Namespace, port: int) -> LocalServer:
    flags = ["--model", args.model] if args.model else []
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    return LocalServer(fleetserve_serve_cmd(port, *flags), port, name="fleetserve")


def _vllm(args: argparse.Namespace, port: int) -> LocalServer:
    from fleetserve.bench.batch_vllm import export_hf_folder

    if not args.vllm_python:
        raise ValueError("--compare vllm needs --vllm-python (a venv with vllm-cpu)")
    folder = export_hf_folder(args.vllm_model, os.path.join(args.work_dir, "hf-model"))
    env = vllm_cpu_env(args.num_threads, os.path.join(args.work_dir, "vllm-cache"))
    cmd = vllm_serve_cmd(args.vllm_python, folder, "smollm2", args.vllm_dtype, port)
    return LocalServer(cmd, port, env, name="vllm", ready_path="/health")


def _llamacpp(args: argparse.Namespace, port: int) -> LocalServer:
    from fleetserve.models.default_model import default_model_path

    binary = args.llama_server or shutil.which("llama-server")
    if not binary:
        raise ValueError("--compare llamacpp needs --llama-server (llama.cpp's server binary)")
    gguf = args.model or default_model_path()
    if not gguf.endswith(".gguf"):
        raise ValueError("--compare llamacpp needs a .gguf --model (or the default model)")
    threads = args.num_threads or os.cpu_count() or 1
    slots = args.streams_max
    cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           "-c", str(1024 * slots), "--host", "127.0.0.1", "--port", str(port),
           "--no-webui", "--alias", "smollm2"]  # fmt: skip
    return LocalServer(cmd, port, name="llamacpp", ready_path="/health")


def add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("served comparison (--compare)")
    g.add_argument(
        "--compare",
        nargs="+",
        choices=PEERS,
        default=None,
        help="serve and measure these (all started at once, measured in turn)",
    )
    g.add_argument("--serial", type=int, default=3, help="requests of a 1-stream measurement")
    g.add_argument("--vllm-python", default=os.environ.get("FLEETSERVE_VLLM_PYTHON"))
    g.add_argument("--vllm-model", default=None, help="HF folder for vLLM (default: the GGUF "
                   "--model dequantized into --work-dir)")  # fmt: skip
    g.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's pick on a bf16 CPU")
    g.add_argument("--llama-server", default=os.environ.get("FLEETSERVE_LLAMA_SERVER"))
    g.add_argument("--work-dir", default="/tmp/fleetserve-bench-structured")
    g.add_argument("--startup-timeout", type=float, default=900.0)
    g.add_argument("--json", default=None, help="write every run's figures here")


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("tpot_ms", "ttft_ms", "tok_s", "cpu_ms_per_token", "tokens_per_request", "load_1m")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    for k in ("valid", "prefix", "bad"):
        out[k] = sum(r[k] for r in runs)
    out["errors"] = sum(len(r["errors"]) for r in runs)
    return out


def table(results: dict[tuple[str, int], dict[str, Any]]) -> str:
    """The markdown table of the medians: per server and stream count, free vs schema."""
    lines = [
        "| server | streams | TPOT free ms | TPOT schema ms | tok/s free | tok/s schema "
        "| schema vs free (tok/s) | CPU ms/token free / schema | tokens/request free / schema "
        "| schema answers valid / cut, starts { / bad |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, streams), s in results.items():
        f, c = s["free"], s["json_schema"]
        ratio = c["tok_s"] / f["tok_s"] - 1.0 if f["tok_s"] else float("nan")
        lines.append(
            f"| {name} | {streams} | {f['tpot_ms']:.1f} | {c['tpot_ms']:.1f} "
            f"| {f['tok_s']:.1f} | {c['tok_s']:.1f} | {100 * ratio:+.1f}% "
            f"| {f['cpu_ms_per_token']:.1f} / {c['cpu_ms_per_token']:.1f} "
            f"| {f['tokens_per_request']:.1f} / {c['tokens_per_request']:.1f} "
            f"| {c['valid']} / {c['prefix']} / {c['bad']} |"
        )
    return "\n".join(lines)


def run_peers(args: argparse.Namespace) -> int:
    if args.serial < 1 or args.rounds < 1 or any(n < 1 for n in args.streams):
        raise ValueError("--serial, --rounds and --streams must be >= 1")
    if "vllm" in args.compare and not args.vllm_python:
        raise ValueError("--compare vllm needs --vllm-python (or $FLEETSERVE_VLLM_PYTHON)")
    if "llamacpp" in args.compare and not (args.llama_server or shutil.which("llama-server")):
        raise ValueError("--compare llamacpp needs --llama-server (or $FLEETSERVE_LLAMA_SERVER)")
    os.makedirs(args.work_dir, exist_ok=True)
    args.streams = sorted(set(args.streams))
    args.streams_max = max(args.streams)
    peers = start_peers(args)
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    offset = 0
    try:
        for p in peers:  # warm-up: kernels, grammar caches, first compile of the schema
            for kind in KINDS:
                measure(p, kind, 2, 2, 8, offset)
                offset += 2
        for rnd in range(args.rounds):
            for p in peers:
                for n in args.streams:
                    for kind in KINDS:
                        num = args.serial if n == 1 else n
                        r = measure(p, kind, n, num, args.max_tokens, offset)
                        offset += num
                        runs.setdefault((p.name, n, kind), []).append(r)
                        print(json.dumps({"round": rnd, "server": p.name, "streams": n,
                                          "kind": kind, **r}), flush=True)  # fmt: skip
    finally:
        for p in peers:
            p.server.stop()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for (name, n, kind), rs in runs.items():
        results.setdefault((name, n), {})[kind] = _summary(rs)
    print(table(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{k[0]}/{k[1]}": v for k, v in results.items()}, f, indent=1)
    return 0
