"""Tensor / pipeline parallel workers as local processes joined by torch.distributed.

The engine process only schedules: every rank (`worker/worker.py`) is a spawned process
that loads its shard, receives each SchedulerOutput through its own Pipe (pickled once,
sent to all) and runs the forward; the output rank sends back the ModelRunnerOutput.
With pipeline parallelism up to `pipeline_parallel_size` steps are in flight at once, so
stage 0 starts the next batch while stage 1 finishes the previous one.

A worker that dies or raises makes the engine raise RuntimeError naming its rank; the
other workers are then stopped (shutdown message, SIGTERM, SIGKILL, in that order).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from fleetserve.config import EngineConfig
from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fleetserve.executor.base import Executor, ModelOutputFuture
from fleetserve.models.loader import ModelSource
from fleetserve.models.sharding import check_parallel_config
from fleetserve.worker.worker import WorkerInit, worker_main

_STOP_GRACE_S = 2.0
PEER_DEATH_GRACE_S = 0.5  # how long a rank's error waits to learn a peer died first


def _free_port() -> int:
    """A port free on the loopback now; two engines on one host each get their own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_workers(procs: list[BaseProcess], conns: list[Connection]) -> None:
    """Ask, then terminate, then kill. Safe to call twice; used by the finalizer too."""
    msg = pickle.dumps(("shutdown", None))
    for proc, conn in zip(procs, conns, strict=True):
        if proc.is_alive():
            with contextlib.suppress(OSError):
                conn.send_bytes(msg)
    for sig in ("terminate", "kill"):
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        for proc in alive:
            getattr(proc, sig)()
    for proc in procs:
        proc.join(timeout=1.0)
    for conn in conns:
        conn.close()


class _PendingOutput(ModelOutputFuture):
    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        while self._output is None:
            self._executor._receive_output()
        return self._output


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        del source  # ModelSource holds open files; each worker resolves the path itself
        par = config.parallel
        check_parallel_config(config.model, par)
        self.config = config
        self.world_size = par.world_size
        self.num_blocks = config.cache.resolve_num_blocks(
            config.model, config.scheduler.max_num_seqs, config.kv_dtype
        )
        # The output rank is TP rank 0 of the last stage (see distributed/parallel_state.py).
        self.output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        threads = max(1, (config.num_threads or os.cpu_count() or 1) // self.world_size)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._pending: deque[_PendingOutput] = deque()
        self._inbox: list[deque[tuple[str, Any]]] = [deque() for _ in range(self.world_size)]
        self._error: str | None = None
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            init = WorkerInit(config, self.num_blocks, rank, init_method, threads)
            proc = ctx.Process(
                target=worker_main, args=(init, child), name=f"fleetserve-rank{rank}", daemon=True
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.worker_info = [self._receive(rank, "ready") for rank in range(self.world_size)]

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    # ------------------------------------------------------------------ steps
    def _broadcast(self, message: tuple[str, Any]) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(f"worker rank {rank} (pid {self._procs[rank].pid}) is gone")

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelOutputFuture:
        self._broadcast(("step", scheduler_output))
        pending = _PendingOutput(self)
        self._pending.append(pending)
        return pending

    def add_lora(self, adapter: Any) -> None:
        # In order with the steps on every rank's pipe: the first step that uses it
        # comes after it. Each rank keeps only its share when it fills a slot.
        self._broadcast(("lora_add", adapter))

    def remove_lora(self, name: str) -> None:
        self._broadcast(("lora_remove", name))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def _receive_output(self) -> None:
        """Resolve the oldest pending step (results arrive in submission order)."""
        self._pending.popleft()._output = self._receive(self.output_rank, "output")

    def _receive(self, rank: int, kind: str) -> Any:
        """Wait for `rank`'s next message of `kind`, watching every worker meanwhile: an
        error message or a process exit from any rank fails the whole replica."""
        if self._error is not None:
            raise RuntimeError(self._error)
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while not self._inbox[rank]:
            ready = wait([*self._conns, *sentinels])
            # Read messages before looking at exits: a result or an error may be queued.
            for r, conn in enumerate(self._conns):
                if conn not in ready:
                    continue
                try:
                    got, payload = conn.recv()
                except (EOFError, OSError):
                    continue  # its sentinel tells how it ended
                if got == "error":
                    self._fail(self._peer_death(r) or str(payload))
                self._inbox[r].append((got, payload))
            if self._inbox[rank]:
                break
            for sentinel in ready:
                dead = sentinels.get(sentinel)  # type: ignore[arg-type]
                if dead is not None:
                    self._fail(self._death(dead))
        got, payload = self._inbox[rank].popleft()
        if got != kind:
            self._fail(f"worker rank {rank} sent {got!r} where {kind!r} was due")
        return payload

    def _peer_death(self, rank: int) -> str | None:
        """A rank's error right after a peer died is that death's echo (its collective read
        the closed socket first): name the dead peer instead, waiting briefly for its exit."""
        others = {p.sentinel: r for r, p in enumerate(self._procs) if r != rank}
        for sentinel in wait(list(others), timeout=PEER_DEATH_GRACE_S):
            return self._death(others[sentinel])  # type: ignore[index]
        return None

    def _death(self, dead: int) -> str:
        return (
            f"worker rank {dead} (pid {self._procs[dead].pid}) died with exit "
            f"code {self._procs[dead].exitcode}; the replica is shut down"
        )

    def _fail(self, message: str) -> None:
        self._error = message
        self.shutdown()
        raise RuntimeError(message)

    # ------------------------------------------------------------------ stats
    def collect_stats(self, reset: bool = False) -> list[dict[str, Any]]:
        """Per-rank step and communication timings (call with no step in flight)."""
        while self._pending:
            self._receive_output()
        self._broadcast(("stats", reset))
        return [self._receive(rank, "stats") for rank in range(self.world_size)]

    def shutdown(self) -> None:
        self._finalizer()
