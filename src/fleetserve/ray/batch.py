"""Batch API lines at scale on Ray Data: a dataset of lines mapped through engine replicas
that are stateful Ray Data actors, across the cluster's nodes.

    import ray
    from fleetserve.batch.lines import BatchLine
    from fleetserve.ray.batch import LineModel, RayBatchOptions, lines_dataset, map_lines

    model = LineModel("chat", "generate", (("chat", "generate"),), engine_args=EngineArgs(...))
    options = RayBatchOptions(num_actors=4, num_cpus_per_actor=2)
    out = map_lines(lines_dataset(lines, options), model, options)  # a lazy Dataset
    for row in out.iter_rows(): row["record"]  # the output line `fleetserve batch run` writes

Each actor (`LineActor`) loads one engine (batch_engine.py: the offline `LLM` for chat and
completion lines, the embedding model for embedding lines) and runs each batch of
`batch_size` lines it is handed as one continuous batch. `fleetserve batch run --ray`
drives this with its checkpoint (`run_batch_on_ray`): it commits each line as its batch
comes back, so an interruption loses at most the batches in flight.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetserve.batch.lines import BatchLine, LineResult, error_result, parse_lines
from fleetserve.batch.runner import EXPIRED_MESSAGE, validate
from fleetserve.batch.store import BatchStore
from fleetserve.ray.batch_engine import LineModel, load_engine

if TYPE_CHECKING:
    import numpy as np
    from ray.data import Dataset

__all__ = ["LineActor", "LineModel", "RayBatchOptions", "lines_dataset", "map_lines", "run_lines"]


@dataclass(frozen=True)
class RayBatchOptions:
    num_actors: int = 1  # engine replicas (Ray Data actors), each with its own model copy
    num_cpus_per_actor: float = 1.0  # Ray's CPU reservation for each actor
    batch_size: int = 32  # lines per actor call: one continuous batch of the engine
    # Batches queued on an actor beyond the running one: keeps it busy between calls,
    # and bounds what an interruption loses (each is lost uncommitted, then re-run).
    max_batches_queued: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_actors, bool) or not 1 <= self.num_actors <= 1024:
            raise ValueError(f"num_actors must be in [1, 1024], got {self.num_actors}")
        if not 0 < self.num_cpus_per_actor <= 1024:
            raise ValueError(
                f"num_cpus_per_actor must be in (0, 1024], got {self.num_cpus_per_actor}"
            )
        if isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_batches_queued < 0:
            raise ValueError(f"max_batches_queued must be >= 0, got {self.max_batches_queued}")


class LineActor:
    """`map_batches`' callable class: one engine per actor, loaded once, then batches of
    rows {line_no, custom_id, url, body (JSON text)} -> {line_no, custom_id, ok, record,
    ready_at (when this actor's engine was loaded: throughput is timed from it)}."""

    def __init__(self, model: LineModel) -> None:
        self.engine = load_engine(model)
        self.ready_at = time.time()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        columns = zip(
            batch["line_no"], batch["custom_id"], batch["url"], batch["body"], strict=True
        )
        lines = [BatchLine(int(n), str(c), str(u), json.loads(b)) for n, c, u, b in columns]
        results = self.engine.run(lines)
        return {
            "line_no": [r.line_no for r in results],
            "custom_id": [r.custom_id for r in results],
            "ok": [r.ok for r in results],
            "record": [r.record for r in results],
            "ready_at": [self.ready_at] * len(results),
        }


def lines_dataset(lines: Sequence[BatchLine], options: RayBatchOptions) -> Dataset:
    """The lines as a dataset of about one block per actor call (the body as JSON text:
    bodies differ in shape, a column holds one type)."""
    import ray.data

    rows = [
        {
            "line_no": x.line_no,
            "custom_id": x.custom_id,
            "url": x.url,
            "body": json.dumps(x.body, ensure_ascii=False),
        }
        for x in lines
    ]
    num_blocks = max(1, math.ceil(len(rows) / options.batch_size))
    return ray.data.from_items(rows, override_num_blocks=num_blocks)


def map_lines(ds: Dataset, model: LineModel, options: RayBatchOptions) -> Dataset:
    """`ds` (rows as `lines_dataset` makes them) through `options.num_actors` engines."""
    from ray.data import ActorPoolStrategy

    return ds.map_batches(
        LineActor,
        fn_constructor_kwargs={"model": model},
        batch_size=options.batch_size,
        compute=ActorPoolStrategy(
            size=options.num_actors,
            max_tasks_in_flight_per_actor=1 + options.max_batches_queued,
        ),
        num_cpus=options.num_cpus_per_actor,
    )


@dataclass(frozen=True)
class RayLineResult:
    result: LineResult
    actor_ready_at: float  # when the engine that ran it had loaded (time.time())


def run_lines(
    lines: Sequence[BatchLine], model: LineModel, options: RayBatchOptions
) -> Iterator[RayLineResult]:
    """Each line's result as its batch comes back (in no particular order)."""
    if not lines:
        return
    out = map_lines(lines_dataset(lines, options), model, options)
    for row in out.iter_rows():
        custom_id = row["custom_id"]
        result = LineResult(
            int(row["line_no"]),
            None if custom_id is None else str(custom_id),
            bool(row["ok"]),
            str(row["record"]),
        )
        yield RayLineResult(result, float(row["ready_at"]))


@dataclass(frozen=True)
class RayRunStats:
    num_run: int  # lines run and committed by this run
    run_s: float  # from the first engine loaded to the last line committed


def run_batch_on_ray(
    store: BatchStore,
    batch_id: str,
    model: LineModel,
    options: RayBatchOptions,
    on_result: Callable[[LineResult], None] | None = None,
) -> RayRunStats:
    """`batch.runner.run_batch` with the lines on Ray Data: takes the store's batch from
    wherever it stopped to completed (or expired, past its window), committing each line
    as it comes back; lines already committed are not sent again."""
    num_run = 0
    first_ready: float | None = None
    last_commit = time.time()
    if not validate(store, batch_id):
        return RayRunStats(0, 0.0)
    batch = store.get_batch(batch_id)
    assert batch is not None
    if batch.status == "in_progress":
        done = store.done_line_nos(batch_id)
        items = parse_lines(store.read_file(batch.input_file_id), batch.endpoint)
        todo = [x for x in items if isinstance(x, BatchLine) and x.line_no not in done]
        deadline = batch.expires_at
        for item in run_lines(todo, model, options):
            if store.commit_result(batch_id, item.result):
                num_run += 1
                if on_result is not None:
                    on_result(item.result)
            last_commit = time.time()
            ready = item.actor_ready_at
            first_ready = ready if first_ready is None else min(first_ready, ready)
            if deadline is not None and last_commit >= deadline:
                break  # past the window: what is not back now is expired
        done = store.done_line_nos(batch_id)
        expired = [
            error_result(x.line_no, x.custom_id, "batch_expired", EXPIRED_MESSAGE)
            for x in todo
            if x.line_no not in done
        ]
        store.finalize(batch_id, "expired" if expired else "completed", expired)
    elif batch.status == "finalizing":
        store.finalize(batch_id, "completed")
    run_s = last_commit - first_ready if first_ready is not None else 0.0
    return RayRunStats(num_run, max(run_s, 0.0))
