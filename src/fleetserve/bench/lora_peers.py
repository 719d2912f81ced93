"""`fleetserve bench lora --compare fleetserve vllm`: the mixed-adapter workload served by
fleetserve and by vLLM's CPU build, on the same base and the same adapters.

The base is an HF folder both load (`--vllm-model`, or the GGUF `--model` / the default
model dequantized to float32 into `--work-dir`); the adapters are random PEFT folders
written for it (bench/lora.py's `write_random_adapter`). Each server starts with
`--enable-lora --lora-modules a0=... a{N-1}=... --max-loras N --max-lora-rank R` (vLLM at
its default dtype, bf16 on this CPU, `--vllm-dtype` to change; fleetserve at its own,
float32 with bf16 adapter slots) and is measured from outside by one streaming client:

    base     `--streams` completions at once, all on the base model
    mixed    the same, request i on adapter a{i % N}
    cold     `POST /v1/load_lora_adapter` of an adapter never seen (timed), then one
             request on it: its TTFT includes whatever loading the server left for the
             first request; beside it the TTFT of one request on an adapter in use.

Every request has a prompt of its own (no prefix-cache hits across requests), greedy,
`ignore_eos`, `--num-tokens` output tokens. Rounds alternate servers (fleetserve base,
mixed, vLLM base, mixed, ...) so a shared machine's load hits both alike; medians of the
rounds are reported, and the server's CPU time per output token beside the wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
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
from fleetserve.bench.structured_peers import server_cpu_s

PEERS = ("fleetserve", "vllm")
PROMPT = "Request {i}: write a long story about a lighthouse keeper and the sea, in detail."


def _lora_flags(adapters: list[str], rank: int, cpu_loras: int) -> list[str]:
    mods = [f"a{i}={path}" for i, path in enumerate(adapters)]
    return ["--enable-lora", "--lora-modules", *mods, "--max-loras", str(len(adapters)),
            "--max-lora-rank", str(rank), "--max-cpu-loras", str(cpu_loras)]  # fmt: skip


def _fleetserve(args: argparse.Namespace, folder: str, flags: list[str]) -> LocalServer:
    port = free_port()
    extra = ["--num-threads", str(args.num_threads)] if args.num_threads else []
    cmd = fleetserve_serve_cmd(port, "--model", folder, "--served-model-name", "base",
                               "--max-num-seqs", str(max(16, args.streams)), *flags, *extra)  # fmt: skip
    return LocalServer(cmd, port, name="fleetserve")


def _vllm(args: argparse.Namespace, folder: str, flags: list[str]) -> LocalServer:
    port = free_port()
    env = vllm_cpu_env(args.num_threads, os.path.join(args.work_dir, "vllm-cache"))
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # its load/unload routes
    cmd = vllm_serve_cmd(args.vllm_python, folder, "base", args.vllm_dtype, port,
                         "--max-num-seqs", str(max(16, args.streams)), *flags)  # fmt: skip
    return LocalServer(cmd, port, env, name="vllm", ready_path="/health")


def _body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT.format(i=i), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def _burst(url: str, bodies: list[dict[str, Any]]) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(client, url, b, None) for b in bodies))
        return list(results), time.perf_counter() - t0


def _throughput(server: LocalServer, models: list[str], offset: int, n: int) -> dict[str, Any]:
    bodies = [_body(m, offset + i, n) for i, m in enumerate(models)]
    load = os.getloadavg()[0]
    cpu0 = server_cpu_s(server)
    results, wall = asyncio.run(_burst(server.url + "/v1/completions", bodies))
    cpu = server_cpu_s(server) - cpu0
    ok = [r for r in results if r.ok]
    tokens = sum(r.num_output_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "tok_s": tokens / wall,
        "cpu_ms_per_token": 1e3 * cpu / max(1, tokens),
        "ttft_mean_ms": 1e3 * statistics.mean(ttfts) if ttfts else float("nan"),
        "tokens": tokens,
        "errors": [r.error for r in results if not r.ok][:3],
        "load_1m": load,
    }


def _one_ttft(server: LocalServer, model: str, i: int) -> float:
    results, _ = asyncio.run(_burst(server.url + "/v1/completions", [_body(model, i, 2)]))
    if not results[0].ok or results[0].ttft_s is None:
        raise RuntimeError(f"{server.name}: {model}: {results[0].error}")
    return 1e3 * results[0].ttft_s


def _cold(server: LocalServer, cold: list[tuple[str, str]], offset: int) -> dict[str, Any]:
    """Loads each `(name, path)` through the admin route, then one request on it."""
    load_ms, cold_ms, warm_ms, base_ms = [], [], [], []
    for k, (name, path) in enumerate(cold):
        base_ms.append(_one_ttft(server, "base", offset + 4 * k))
        warm_ms.append(_one_ttft(server, "a0", offset + 4 * k + 1))
        t0 = time.perf_counter()
        r = httpx.post(
            server.url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": path},
            timeout=300,
        )
        load_ms.append(1e3 * (time.perf_counter() - t0))
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: load {name}: {r.status_code} {r.text[:200]}")
        cold_ms.append(_one_ttft(server, name, offset + 4 * k + 2))
    med = statistics.median
    return {
        "ttft_base_ms": med(base_ms),
        "ttft_loaded_adapter_ms": med(warm_ms),
        "load_route_ms": med(load_ms),
        "ttft_cold_adapter_ms": med(cold_ms),
        "load_plus_ttft_cold_ms": med(a + b for a, b in zip(load_ms, cold_ms, strict=True)),
    }


def run_peers(args: argparse.Namespace, write_adapter: Any) -> int:
    from fleetserve.bench.batch_vllm import export_hf_folder
    from fleetserve.engine.arg_utils import EngineArgs

    if "vllm" in args.compare and not args.vllm_python:
        raise ValueError("--compare vllm needs --vllm-python (or $FLEETSERVE_VLLM_PYTHON)")
    if args.streams < 1 or args.num_adapters < 1 or args.rounds < 1:
        raise ValueError("--streams, --num-adapters and --rounds must be >= 1")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    folder = export_hf_folder(args.vllm_model or args.model, str(work / "hf-model"))
    cfg, _ = EngineArgs(model=folder).resolve()
    adapters = [
        write_adapter(cfg.model, work / f"a{i}", args.rank, i, args.target_tuple)
        for i in range(args.num_adapters)
    ]
    num_cold = 3
    cold_paths = [
        write_adapter(cfg.model, work / f"cold{k}", args.rank, 100 + k, args.target_tuple)
        for k in range(num_cold)
    ]
    # Room for the served adapters and the cold ones (no eviction in the measurement).
    flags = _lora_flags(adapters, args.rank, args.num_adapters + num_cold)
    servers: dict[str, LocalServer] = {}
    try:
        for name in args.compare:
            start = _fleetserve if name == "fleetserve" else _vllm
            server = start(args, folder, flags)
            servers[name] = server
            print(f"{name}: starting on {server.url} (log {server.log.name})", flush=True)
        for server in servers.values():
            server.wait_ready(args.startup_timeout)
        mixed = [f"a{i % args.num_adapters}" for i in range(args.streams)]
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        offset = 0
        for server in servers.values():  # warm-up: every adapter once
            _throughput(server, [*mixed[: args.num_adapters], "base"], offset, 4)
        offset += 1000
        for rnd in range(args.rounds):
            for name, server in servers.items():
                for kind, models in (("base", ["base"] * args.streams), ("mixed", mixed)):
                    r = _throughput(server, models, offset, args.num_tokens)
                    offset += args.streams
                    runs.setdefault((name, kind), []).append(r)
                    print(json.dumps({"round": rnd, "server": name, "kind": kind, **r}),
                          flush=True)  # fmt: skip
        cold: dict[str, dict[str, Any]] = {}
        for name, server in servers.items():
            cold[name] = _cold(server, [(f"cold{k}", p) for k, p in enumerate(cold_paths)], offset)
            offset += 100
            print(json.dumps({"server": name, **cold[name]}), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary = _summary(runs, cold)
    print(table(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": {f"{k[0]}/{k[1]}": v for k, v in
                                                        runs.items()}, "summary": summary},
                                              indent=1))  # fmt: skip
    return 0


def _summary(
    runs: dict[tuple[str, str], list[dict[str, Any]]], cold: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for (name, kind), rs in runs.items():
        s = out.setdefault(name, {})
        for key in ("tok_s", "cpu_ms_per_token", "ttft_mean_ms", "load_1m"):
            s[f"{kind}_{key}"] = statistics.median(r[key] for r in rs)
        s[f"{kind}_errors"] = sum(len(r["errors"]) for r in rs)
    for name, s in out.items():
        s["mixed_vs_base"] = s["mixed_tok_s"] / s["base_tok_s"]
        s.update(cold.get(name, {}))
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| server | base tok/s | mixed tok/s | mixed / base | CPU ms/token base / mixed "
        "| TTFT ms: base / adapter in use / cold (after load route) | load route ms | load 1m |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['base_tok_s']:.1f} | {s['mixed_tok_s']:.1f} "
            f"| {s['mixed_vs_base']:.2f} "
            f"| {s['base_cpu_ms_per_token']:.2f} / {s['mixed_cpu_ms_per_token']:.2f} "
            f"| {s.get('ttft_base_ms', float('nan')):.0f} / "
            f"{s.get('ttft_loaded_adapter_ms', float('nan')):.0f} / "
            f"{s.get('ttft_cold_adapter_ms', float('nan')):.0f} "
            f"| {s.get('load_route_ms', float('nan')):.0f} "
            f"| {s['base_load_1m']:.1f} |"
        )
    if {"fleetserve", "vllm"} <= summary.keys():
        f, v = summary["fleetserve"], summary["vllm"]
        lines.append("")
        lines.append(
            f"fleetserve / vLLM: base {f['base_tok_s'] / v['base_tok_s']:.2f}x, "
            f"mixed {f['mixed_tok_s'] / v['mixed_tok_s']:.2f}x"
        )
    return "\n".join(lines)
