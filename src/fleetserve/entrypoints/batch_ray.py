"""`fleetserve batch run ... --ray`: the lines on Ray Data actors (fleetserve.ray.batch).

The same INPUT, OUTPUT and checkpoint (OUTPUT.ckpt/) as the local run, so a job may
start locally and finish on Ray, or the reverse. Joins the cluster at --ray-address
(`auto`: the one this machine is in), or starts a local Ray and stops it at the end.
The model is the engine flags' one (chat and completion lines), or the fleet file's one
model of the kind the file's endpoint needs (generate, or embed for embedding lines).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from fleetserve.entrypoints.engine_args_cli import engine_args_from


def check_ray_args(args: argparse.Namespace) -> None:
    """ValueError for flags the Ray run does not use or cannot take."""
    try:
        import ray.data  # noqa: F401
    except ImportError:
        raise ValueError("--ray needs Ray Data: pip install 'fleetserve[ray]'") from None
    if args.oversubscribe is not None:
        raise ValueError("--oversubscribe is for the local run (its class queue); leave it out")
    if args.ray_actors is not None and not 1 <= args.ray_actors <= 1024:
        raise ValueError(f"--ray-actors must be in [1, 1024], got {args.ray_actors}")
    cpus = args.ray_cpus_per_actor
    if cpus is not None and not 0 < cpus <= 1024:
        raise ValueError(f"--ray-cpus-per-actor must be in (0, 1024], got {cpus:g}")


def _line_model(args: argparse.Namespace, endpoint: str) -> Any:
    from fleetserve.batch.lines import EMBEDDINGS_URL
    from fleetserve.entrypoints.openai.server_args import served_name
    from fleetserve.ray.batch_engine import LineModel, line_model
    from fleetserve.serve.config.fleet_config import load_fleet_config

    if args.config is not None:
        return line_model(load_fleet_config(args.config), endpoint)
    if endpoint == EMBEDDINGS_URL:
        raise ValueError("embedding lines need an embed model: give it in a --config fleet file")
    engine_args = engine_args_from(args)
    name = served_name(engine_args, args.served_model_name)
    return LineModel(name, "generate", ((name, "generate"),), engine_args=engine_args)


def _batch_size(args: argparse.Namespace, model: Any) -> int:
    """--concurrency, else two engine batches' worth of lines per actor call."""
    if args.concurrency is not None:
        return int(args.concurrency)
    if model.engine_args is not None:
        return 2 * int(model.engine_args.max_num_seqs)
    return 2 * (model.batching.max_batch_size if model.batching is not None else 32)


def run_on_ray(
    args: argparse.Namespace,
    store: Any,
    batch_id: str,
    progress: Callable[[Any, str, bool], Any],
) -> None:
    import ray

    from fleetserve.ray.batch import RayBatchOptions, run_batch_on_ray

    batch = store.get_batch(batch_id)
    model = _line_model(args, batch.endpoint)  # a bad flag or file fails before Ray starts
    options = RayBatchOptions(
        num_actors=args.ray_actors or 1,
        num_cpus_per_actor=args.ray_cpus_per_actor or 1.0,
        batch_size=_batch_size(args, model),
    )
    started_here = args.ray_address is None
    if started_here:
        # "local": a Ray of its own, even where another runs on this machine.
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.ray_address, log_to_driver=False)
    bar = None
    try:
        _quiet_ray_data(args.progress)
        bar = progress(store, batch_id, args.progress)
        stats = run_batch_on_ray(store, batch_id, model, options, on_result=bar)
    finally:
        if bar is not None:
            bar.close()
        ray.shutdown()  # a joined cluster stays up; this process only leaves it
    rate = stats.num_run / max(stats.run_s, 1e-9)
    print(
        f"fleetserve: ran {stats.num_run} lines in {stats.run_s:.2f} s ({rate:.1f} lines/s, "
        f"{options.num_actors} Ray actors of {options.batch_size} lines a call)",
        file=sys.stderr,
    )


def _quiet_ray_data(progress: bool) -> None:
    """The command's own bar counts lines; Ray Data's bars would draw over it."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    if not progress:
        ctx.print_on_execution_start = False
