"""`fleetserve batch run INPUT.jsonl -o OUTPUT.jsonl`: OpenAI batch lines, offline, resumable.

The lines run in this process's fleet (one model from the engine flags, or every model of
a `--config` fleet file) as one continuous stream: the same runner, store, executor and
handlers as the server's Batch API. Progress is checkpointed line by line in
OUTPUT.ckpt/ (a SQLite store beside OUTPUT): after an interruption (Ctrl-C, kill -9, a
preempted spot worker) the same command skips every line already done. OUTPUT is written
once all lines are done: every line of INPUT exactly once, in input order, results and
errors together (vLLM's run_batch format: `error` is null on success).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from typing import Any

from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from


def add_cli_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="batch_command", metavar="BATCH")
    r = sub.add_parser("run", help="run a JSONL file of OpenAI batch lines offline")
    r.add_argument("input", help="JSONL input: {custom_id, method, url, body} per line")
    r.add_argument("-o", "--output", required=True, help="JSONL output (written at the end)")
    r.add_argument(
        "--config",
        default=None,
        help="fleet YAML file: its models serve the lines by name (instead of --model)",
    )
    r.add_argument("--served-model-name", default=None, help="the model name lines may send")
    r.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="lines in flight (default: 2 x --max-num-seqs, so the scheduler never starves); "
        "with --ray, the lines of each actor call",
    )
    r.add_argument(
        "--oversubscribe",
        type=float,
        default=None,
        help="batches' worth of lines the engine holds at once, the surplus in its own queue "
        "(default: --concurrency / --max-num-seqs; 1 sends one batch, refilled line by line)",
    )
    r.add_argument("--no-progress", dest="progress", action="store_false")
    g = r.add_argument_group("ray (pip install fleetserve[ray])")
    g.add_argument(
        "--ray",
        action="store_true",
        help="spread the lines over engine replicas that are Ray Data actors, across nodes",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="the cluster to join (auto: the one this machine is in; HOST:PORT); "
        "default: start a local Ray",
    )
    g.add_argument("--ray-actors", type=int, default=None, help="engine replicas (default 1)")
    g.add_argument(
        "--ray-cpus-per-actor", type=float, default=None, help="CPUs Ray reserves per actor (1)"
    )
    add_engine_args(r)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "batch_command", None) != "run":
        print("usage: fleetserve batch run INPUT.jsonl -o OUTPUT.jsonl", file=sys.stderr)
        return 2
    if args.config is not None:
        defaults = argparse.ArgumentParser()
        add_engine_args(defaults)
        given = [k for k, v in vars(defaults.parse_args([])).items() if getattr(args, k) != v]
        given += [k for k in ("served_model_name", "oversubscribe") if getattr(args, k) is not None]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ValueError(f"--config describes every model; leave out {flags}")
    concurrency = args.concurrency or 2 * args.max_num_seqs
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if args.ray:
        from fleetserve.entrypoints.batch_ray import check_ray_args

        check_ray_args(args)
    else:
        ray_flags = ("ray_address", "ray_actors", "ray_cpus_per_actor")
        given = [f for f in ray_flags if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --ray")
        if args.oversubscribe is None:
            # Every line in flight goes to the engine: the surplus over one batch waits in
            # its queue, so a finished line's slot is refilled on the next step.
            args.oversubscribe = min(64.0, max(1.0, concurrency / args.max_num_seqs))
        elif not 1.0 <= args.oversubscribe <= 64.0:
            raise ValueError(f"--oversubscribe must be in [1, 64], got {args.oversubscribe:g}")
    return asyncio.run(_run(args, concurrency))


async def _run(args: argparse.Namespace, concurrency: int) -> int:
    from fleetserve.batch.store import BatchStore

    try:
        with open(args.input, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"INPUT: cannot read {args.input!r}: {e.strerror}") from None
    store = BatchStore(f"{args.output}.ckpt")
    try:
        batch_id = _checkpointed_batch(store, args.input, data)
        batch = store.get_batch(batch_id)
        assert batch is not None
        if batch.status not in ("completed", "expired"):
            if args.ray:
                from fleetserve.entrypoints.batch_ray import run_on_ray

                run_on_ray(args, store, batch_id, _progress)
            else:
                await _run_on_engine(args, store, batch_id, concurrency)
        _write_output(store, batch_id, args.output)
    finally:
        store.close()
    return 0


def _checkpointed_batch(store: Any, input_path: str, data: bytes) -> str:
    """The checkpoint's batch for this INPUT, created on the first run."""
    from fleetserve.batch.lines import first_url, split_input

    digest = hashlib.sha256(data).hexdigest()
    page, _ = store.list_batches(None, 1)
    if page:
        batch = page[0]
        if (batch.metadata or {}).get("input_sha256") != digest:
            raise ValueError(
                f"INPUT differs from the one checkpointed in {store.state_dir}; "
                "delete that folder to start over"
            )
        return str(batch.id)
    try:
        raw_lines = split_input(data)
    except ValueError as e:
        raise ValueError(f"INPUT: {e}") from None
    endpoint = first_url(raw_lines)
    if endpoint is None:
        raise ValueError("INPUT: no line has a supported url; see `fleetserve batch run --help`")
    source = store.add_file(data, os.path.basename(input_path), "batch")
    meta = {"input_sha256": digest, "input_path": os.path.abspath(input_path)}
    return str(store.create_batch(source.id, endpoint, "24h", meta).id)


def _registry(args: argparse.Namespace, n: int) -> Any:
    """The fleet file's models, or the engine flags' one model."""
    from fleetserve.entrypoints.openai.server_args import served_name
    from fleetserve.metrics import ServerMetrics
    from fleetserve.serve.config.fleet_config import load_fleet_config, single_model_fleet
    from fleetserve.serve.services.service_registry import build_registry

    if args.config is not None:
        fleet = load_fleet_config(args.config)
    else:
        engine_args = engine_args_from(args)
        name = served_name(engine_args, args.served_model_name)
        fleet = single_model_fleet(
            name, engine_args, 1, "least_loaded", n, oversubscribe=args.oversubscribe
        )
    try:
        return build_registry(fleet, ServerMetrics())
    except OSError as e:  # a missing checkpoint
        raise ValueError(str(e)) from e


async def _run_on_engine(args: argparse.Namespace, store: Any, batch_id: str, n: int) -> None:
    from fleetserve.batch.runner import run_batch
    from fleetserve.entrypoints.openai.batch_executor import FleetLineExecutor
    from fleetserve.entrypoints.openai.serving_common import ServingContext

    registry = _registry(args, n)
    server = ServingContext(registry, max_body_bytes=0)
    bar = None
    try:
        await registry.start()
        bar = _progress(store, batch_id, args.progress)
        t0 = time.perf_counter()
        await run_batch(store, batch_id, FleetLineExecutor(server), n, on_result=bar)
        run_s = time.perf_counter() - t0
        steps = _engine_steps(registry)
    finally:
        if bar is not None:
            bar.close()
        await registry.shutdown()
    # Timed from the model being loaded, so that throughput figures leave start-up out.
    rate = bar.num_run / max(run_s, 1e-9)
    print(
        f"fleetserve: ran {bar.num_run} lines in {run_s:.2f} s ({rate:.1f} lines/s, "
        f"{steps} engine steps)",
        file=sys.stderr,
    )


def _engine_steps(registry: Any) -> int:
    """Steps the generate engines ran (from their latest stats): fewer for the same lines
    means fuller batches, a figure that does not move with the machine's load."""
    replicas = [r for s in registry if s.kind == "generate" for r in s.replica_set]
    return sum(r.stats.num_steps if r.stats is not None else 0 for r in replicas)


class _Progress:
    """tqdm bar: lines done (with how many failed), rate and ETA."""

    def __init__(self, total: int, done: int, failed: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.failed = failed
        self.num_run = 0
        self.bar = tqdm(
            total=total, initial=done, unit="line", disable=not enabled, dynamic_ncols=True
        )
        self.bar.set_postfix(failed=failed)

    def __call__(self, result: Any) -> None:
        self.num_run += 1
        if not result.ok:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _progress(store: Any, batch_id: str, enabled: bool) -> _Progress:
    from fleetserve.batch.runner import validate

    validate(store, batch_id)  # counts are known only once the lines are parsed
    batch = store.get_batch(batch_id)
    return _Progress(batch.total, batch.completed + batch.failed, batch.failed, enabled)


def _write_output(store: Any, batch_id: str, path: str) -> None:
    records = store.results(batch_id)
    batch = store.get_batch(batch_id)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record + "\n")
    os.replace(tmp, path)
    print(
        f"fleetserve: {len(records)} lines ({batch.completed} ok, {batch.failed} failed) -> {path}",
        file=sys.stderr,
    )
