"""`fleetserve bench chaos`: replicas killed under streaming load, and what clients see.

Starts a local fleet (`fleetserve serve -dp N` on 127.0.0.1; a tiny random model by
default) and sends the same workload (`--num-requests` streamed completions, half greedy
and half seeded sampling, at most `--concurrency` in flight) several times:
1. `reference`: undisturbed;
2. one phase per `--faults` signal: every `--interval` seconds, `--num-faults` times, the
   engine process of the replica holding the most requests gets SIGKILL (a crash) or
   SIGTERM (a spot / Kubernetes notice: it drains and its requests move).
Each stream is checked against its reference twin (text, usage, finish reason): a
request lost (an error) or unlike its twin (a token duplicated or missing) is counted.
Latencies (TTFT, end to end) are reported per phase, and for the requests that moved to
another replica (the server's migration log, checked against its
`fleetserve:request_migrations_total`) with the time each move added. Each fault is timed
from outside: process gone, replica out of routing, replacement started and ready.

`--compare ray` runs the same load and SIGKILLs against a plain Ray Serve deployment of
the same model (fleetserve.bench.ray_hf_baseline, HF transformers in each of N replicas):
its in-flight requests on a killed replica fail.

Engine steps of a tiny model take microseconds, so requests would end before any fault;
`--step-delay` makes every step (fleetserve) and every token (Ray) take that long more,
as a real model on a real device would. Only processes the benchmark started are
signalled, each by pid after checking it descends from the benchmark's server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from fleetserve.bench.chaos_faults import (
    SIGNALS,
    FaultRecord,
    FaultTarget,
    FleetserveTarget,
    RayServeTarget,
    run_faults,
)
from fleetserve.bench.chaos_report import format_report, migrated_ids, phase_summary
from fleetserve.bench.local_server import LocalServer, free_port
from fleetserve.bench.serve import parse_range, stream_completion, synthetic_prompts
from fleetserve.bench.serve_metrics import RequestResult

SERVED_NAME = "chaos"
# `fleetserve serve` with the fleet's migration log (logger fleetserve.serve, INFO) on
# stderr, which is how the benchmark knows which requests moved.
_SERVE_WITH_MIGRATION_LOG = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(name)s %(message)s')\n"
    "logging.getLogger('fleetserve.serve').setLevel(logging.INFO)\n"
    "from fleetserve.entrypoints.cli import main\n"
    "sys.exit(main())\n"
)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny (random, built now) | smollm2 | PATH")
    p.add_argument("--num-replicas", type=int, default=2, help="fleetserve -dp; Ray replicas")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--input-len", default="16:64", help="prompt words: N or LO:HI")
    p.add_argument("--output-len", default="32:128", help="max_tokens (EOS ignored): N or LO:HI")
    p.add_argument("--faults", default="sigkill,sigterm", help="phases: sigkill, sigterm")
    p.add_argument("--num-faults", type=int, default=3, help="signals per fault phase")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between signals")
    p.add_argument("--sigterm-grace", type=float, default=15.0, help="fleetserve --sigterm-grace")
    p.add_argument("--max-num-seqs", type=int, default=16, help="batch size per replica")
    p.add_argument(
        "--step-delay", type=float, default=0.02, help="seconds added to each step / token"
    )
    p.add_argument("--compare", choices=["ray"], default=None, help="also a Ray Serve app")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="write the report here")


def _validate(args: argparse.Namespace) -> list[str]:
    for name in ("num_replicas", "num_requests", "concurrency", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_replicas < 2:
        raise ValueError("--num-replicas must be >= 2: a fault needs a replica to move to")
    if args.num_faults < 0:
        raise ValueError(f"--num-faults must be >= 0, got {args.num_faults}")
    for name in ("interval", "timeout", "sigterm_grace"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.step_delay < 0:
        raise ValueError(f"--step-delay must be >= 0, got {args.step_delay}")
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in SIGNALS]
    if unknown:
        raise ValueError(f"--faults: unknown {unknown}; choose from {sorted(SIGNALS)}")
    return faults


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The request bodies: even ones greedy, odd ones sampled with a seed of their own."""
    prompts = synthetic_prompts(
        args.num_requests,
        args.seed,
        parse_range(args.input_len, "--input-len"),
        parse_range(args.output_len, "--output-len"),
    )
    bodies = []
    for i, p in enumerate(prompts):
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
        bodies.append(
            {
                "model": SERVED_NAME, "prompt": p.prompt, "max_tokens": p.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                **sampling,
            }
        )  # fmt: skip
    return bodies


async def _load(
    url: str, bodies: list[dict[str, Any]], concurrency: int, timeout_s: float
) -> list[RequestResult]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def one(body: dict[str, Any]) -> RequestResult:
            async with gate:
                call = stream_completion(client, f"{url}/v1/completions", body, body["max_tokens"])
                try:
                    return await asyncio.wait_for(call, timeout_s)
                except asyncio.TimeoutError:
                    return RequestResult(0, 0, body["max_tokens"], error=f"timeout {timeout_s} s")

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def _migrations_total(url: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0  # a labelled counter has no sample before its first move
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "fleetserve:request_migrations_total":
                total += s.value
    return total


def _wait_full(target: FaultTarget, num_replicas: int, timeout_s: float) -> None:
    """Until the server has `num_replicas` replicas again (ready ones, where it says)."""
    want = "ready" if target.knows_readiness else "running"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if list(target.replica_states().values()).count(want) >= num_replicas:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the server did not get back to {num_replicas} replicas in {timeout_s} s")


def run_phase(
    system: str,
    phase: str,
    target: FaultTarget,
    bodies: list[dict[str, Any]],
    args: argparse.Namespace,
    metrics: Callable[[], float | None],
) -> tuple[list[RequestResult], list[FaultRecord], list[str], dict[str, Any]]:
    """One pass of the workload, with `phase`'s signal sent meanwhile (none: reference)."""
    server = target.server
    _wait_full(target, args.num_replicas, args.startup_timeout)
    log_start = len(server.output())
    moves0 = metrics()
    faults: list[FaultRecord] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def inject() -> None:
        try:
            faults.extend(run_faults(target, phase, args.num_faults, args.interval, stop))
        except BaseException as e:  # raised in the bench's thread once the load is over
            failures.append(e)

    chaos = threading.Thread(target=inject, daemon=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    if phase in SIGNALS:
        chaos.start()
    try:
        results = asyncio.run(_load(server.url, bodies, args.concurrency, args.timeout))
    finally:
        stop.set()
    duration = time.perf_counter() - t0
    if phase in SIGNALS:
        chaos.join()  # the last fault's measurement may outlast the load
    if failures:
        raise RuntimeError(f"{system} {phase}: the fault injection failed") from failures[0]
    moves = migrated_ids(server.output()[log_start:])
    moves1 = metrics()
    extra = {
        "system": system,
        "phase": phase,
        "duration_s": duration,
        "num_migrations_metric": None if moves1 is None else moves1 - (moves0 or 0.0),
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": os.getloadavg()[0],
    }
    print(f"{system} {phase}: {duration:.1f} s, {len(faults)} faults", flush=True)
    return results, faults, moves, extra


def run_system(
    system: str,
    target: FaultTarget,
    bodies: list[dict[str, Any]],
    reproducible: list[bool],
    phases: list[str],
    args: argparse.Namespace,
    metrics: Callable[[], float | None],
) -> list[dict[str, Any]]:
    """The reference pass, then one pass per fault phase, each summarized against it."""
    # Warm-up: the first requests of a fresh server pay one-time costs.
    asyncio.run(_load(target.server.url, bodies[:2], 2, args.timeout))
    reference, _, moves, extra = run_phase(system, "reference", target, bodies, args, metrics)
    runs = [phase_summary(reference, reference, reproducible, moves, [], extra)]
    for phase in phases:
        results, faults, moves, extra = run_phase(system, phase, target, bodies, args, metrics)
        runs.append(phase_summary(results, reference, reproducible, moves, faults, extra))
    return runs


def _model_path(args: argparse.Namespace, tmp: str) -> str:
    if args.model == "tiny":
        from fleetserve.models.make_model import make_model

        return make_model(os.path.join(tmp, "tiny"), "llama", "tiny", seed=args.seed)
    if args.model == "smollm2":
        from fleetserve.models.default_model import default_model_path

        return default_model_path()
    if not os.path.exists(args.model):
        raise ValueError(f"--model {args.model!r}: no such file or folder (or tiny, smollm2)")
    return os.path.abspath(args.model)


def start_fleetserve(args: argparse.Namespace, model: str, state_dir: str) -> LocalServer:
    port = free_port()
    cmd = [
        sys.executable, "-c", _SERVE_WITH_MIGRATION_LOG, "serve", "--model", model,
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "-dp", str(args.num_replicas), "--max-num-seqs", str(args.max_num_seqs),
        "--sigterm-grace", str(args.sigterm_grace), "--seed", str(args.seed),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {"FLEETSERVE_STATE_DIR": state_dir}
    if args.step_delay:
        env["FLEETSERVE_DEBUG_STEP_DELAY_S"] = str(args.step_delay)
    return LocalServer(cmd, port, env, name="fleetserve").wait_ready(args.startup_timeout)


def start_ray(args: argparse.Namespace, model: str) -> LocalServer:
    port = free_port()
    cmd = [
        sys.executable, "-m", "fleetserve.bench.ray_hf_baseline", "--model", model,
        "--served-model-name", SERVED_NAME, "--port", str(port),
        "--num-replicas", str(args.num_replicas), "--num-cpus", str(args.num_replicas),
        "--num-threads", "1", "--max-ongoing-requests", str(args.max_num_seqs),
        "--token-delay-s", str(args.step_delay),
    ]  # fmt: skip
    return LocalServer(cmd, port, name="ray-serve").wait_ready(args.startup_timeout)


def run(args: argparse.Namespace) -> int:
    phases = _validate(args)
    bodies = workload(args)
    report: dict[str, Any] = {
        "model": args.model,
        "num_replicas": args.num_replicas,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_faults": args.num_faults,
        "interval_s": args.interval,
        "sigterm_grace_s": args.sigterm_grace,
        "step_delay_s": args.step_delay,
        "max_num_seqs": args.max_num_seqs,
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="fleetserve-chaos-") as tmp:
        model = _model_path(args, tmp)
        server = start_fleetserve(args, model, tmp)
        try:
            report["runs"] += run_system(
                "fleetserve", FleetserveTarget(server), bodies, [True] * len(bodies), phases,
                args, lambda: _migrations_total(server.url),
            )  # fmt: skip
        finally:
            server.stop()
        if args.compare == "ray":
            # Ray's baseline samples without a seed: only its greedy streams repeat.
            ray_bodies = [{k: v for k, v in b.items() if k != "seed"} for b in bodies]
            greedy = [b["temperature"] == 0.0 for b in bodies]
            ray = start_ray(args, model)
            try:
                report["runs"] += run_system(
                    "ray-serve", RayServeTarget(ray), ray_bodies, greedy, ["sigkill"], args,
                    lambda: None,
                )  # fmt: skip
            finally:
                ray.stop()
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0
