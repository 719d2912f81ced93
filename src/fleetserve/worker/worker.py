"""One rank of a TP x PP replica, in its own process (started by MultiprocExecutor).

The engine process and each worker are joined by a `multiprocessing` Pipe. Messages in
(pickled once by the executor, sent to every rank):

    ("step", SchedulerOutput)   run one step; the output rank answers ("output", result)
    ("stats", reset: bool)      answer ("stats", dict) with this rank's timings (and its
                                C-step count, ModelRunner.path_counts)
    ("shutdown", None)          leave the process group and exit

Messages out: ("ready", info) once loaded, ("output", ModelRunnerOutput), ("stats", dict),
and ("error", traceback text) just before a worker that failed exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from fleetserve.config import EngineConfig


@dataclass(frozen=True)
class WorkerInit:
    config: EngineConfig
    num_blocks: int
    rank: int
    init_method: str  # tcp://127.0.0.1:PORT, a port the executor found free
    num_threads: int


@dataclass
class StepTimer:
    """Where a rank's time went since the last reset: a stage is busy while it computes;
    waiting for the engine's next step or for the previous stage's hidden states is idle."""

    window_start: float | None = None
    window_end: float = 0.0
    step_s: float = 0.0
    num_steps: int = 0

    def report(self, comm: dict[str, float]) -> dict[str, Any]:
        window = self.window_end - self.window_start if self.window_start else 0.0
        busy = self.step_s - comm["recv_s"]
        return {
            "num_steps": self.num_steps,
            "window_s": window,
            "busy_s": busy,
            "idle_fraction": 1.0 - busy / window if window > 0 else 0.0,
            **comm,
        }


def worker_main(init: WorkerInit, conn: Connection) -> None:
    # Ctrl-C reaches the whole process group; the engine process owns shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _run(init, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine process is gone: nothing left to serve
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", f"worker rank {init.rank}: {traceback.format_exc()}"))
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    # Interpreter teardown (torch's process-group destructors) takes over a second and
    # releases nothing the OS does not release anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(init: WorkerInit, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from fleetserve.distributed.parallel_state import CommStats, init_distributed
    from fleetserve.models.loader import resolve_model
    from fleetserve.worker.model_runner import ModelRunner

    config = init.config
    torch.set_num_threads(init.num_threads)
    torch.manual_seed(config.seed)
    backend = "gloo"
    if config.device.startswith("cuda"):
        backend = "nccl"
        config = replace(config, device=f"cuda:{init.rank % torch.cuda.device_count()}")
        torch.cuda.set_device(config.device)
    par = config.parallel
    ctx = init_distributed(
        init.rank,
        par.tensor_parallel_size,
        par.pipeline_parallel_size,
        init.init_method,
        backend,
        par.expert_parallel,
    )
    source = resolve_model(config.model_path)
    runner = ModelRunner(config, source, init.num_blocks, parallel=ctx)
    conn.send(("ready", {"rank": init.rank, "pid": os.getpid(), "load_s": runner.load_seconds}))
    timer = StepTimer()
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "step":
            t0 = time.perf_counter()
            if timer.window_start is None:
                timer.window_start = t0
            result = runner.execute_model(payload)
            t1 = time.perf_counter()
            timer.step_s += t1 - t0
            timer.window_end = t1
            timer.num_steps += 1
            if ctx.is_output_rank:
                conn.send(("output", result))
        elif kind in ("lora_add", "lora_remove"):
            assert runner.lora is not None, "LoRA is off in this engine"
            if kind == "lora_add":
                runner.lora.add(payload)
            else:
                runner.lora.remove(payload)
        elif kind == "stats":
            report = {"rank": init.rank, **timer.report(ctx.stats.as_dict())}
            conn.send(("stats", {**report, **runner.path_counts()}))
            if payload:
                timer = StepTimer()
                ctx.stats.__dict__.update(CommStats().__dict__)
        elif kind == "shutdown":
            ctx.wait_sends()
            dist.destroy_process_group()
            return
        else:
            raise RuntimeError(f"unknown message {kind!r}")
