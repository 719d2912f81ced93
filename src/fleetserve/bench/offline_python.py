"""The serial Python of an offline run: what the engine's thread spends outside the C step.

`python -m fleetserve.bench.offline_python [--workload PATH] [--threads T] [--stub [--reps N]]`
runs a workload (as `fleetserve bench offline`: greedy, ignore_eos, max_num_seqs 64)
through `LLM.generate` and reports the calling thread's CPU seconds (`time.thread_time`:
figures that hold on a busy machine) by part: the scheduler, the runner's state diffs,
metadata and sampling, the model's Python around the C step (embedding lookup, the
step's arguments), the scheduler's update, the output processor (detokenizing), the rest
(LLM's loop). Everything but `c_step` runs while the step's other threads wait.

`--beside MS` times a captured 64-row decode step alone and beside MS of pure Python
in another thread: whether preparing the next step during this one would pay.

`--stub` replaces the C step by a stand-in that reads 48 MB (as a step's weights evict
the caches), writes a fixed token as every row's argmax and returns: the same steps,
rows and Python (tokens do not steer a greedy, ignore_eos run's schedule) in seconds
instead of minutes, best of `--reps` runs: an A/B of Python changes on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fleetserve.bench.offline import bench_model_path
from fleetserve.bench.workloads import load_workload

_clock = time.thread_time


def _timed(acc: dict[str, float], key: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> Any:
        t0 = _clock()
        try:
            return f(*args, **kwargs)
        finally:
            acc[key] += _clock() - t0

    return inner


def measure(
    model: str, workload: str, threads: int, stub: bool = False, reps: int = 1
) -> dict[str, Any]:
    """Thread CPU ms by part (the best of `reps` runs by total Python), steps run."""
    from fleetserve import LLM, SamplingParams
    from fleetserve.worker import model_runner

    torch.set_num_threads(threads)
    reqs = load_workload(workload)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    llm = LLM(model=model, max_model_len=longest + 16, max_num_seqs=64, num_threads=threads, seed=0)
    engine, core = llm.engine, llm.engine.core
    runner = core.executor.runner  # type: ignore[attr-defined]
    plan = runner.model.model.decode_plan
    if plan is None:
        raise ValueError("this model has no C step here (FLEETSERVE_FUSED_DECODE=0?)")
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2), use_tqdm=False)
    acc: dict[str, float] = defaultdict(float)
    run = plan.run
    if stub:
        flush = np.ones(12 << 20, dtype=np.float32)

        def stand_in(x: torch.Tensor, *args: Any) -> torch.Tensor:
            flush.sum()
            if len(args) > 11 and args[11] is not None:
                args[11].fill_(min(1234, plan.vocab - 1))
            return torch.empty(x.shape[0], plan.shape.hidden)

        run = stand_in
    saved = [
        (plan, "run", run),
        (core.scheduler, "schedule", core.scheduler.schedule),
        (core.scheduler, "update_from_output", core.scheduler.update_from_output),
        (engine.output_processor, "process", engine.output_processor.process),
        (runner, "_update_states", runner._update_states),
        (runner, "_sample", runner._sample),
        (runner, "execute_model", runner.execute_model),
        (runner.model, "forward", runner.model.forward),
    ]
    meta_fns = [
        n for n in ("build_attention_metadata", "build_cpu_metadata") if hasattr(model_runner, n)
    ]
    saved += [(model_runner, n, getattr(model_runner, n)) for n in meta_fns]
    keys = ["c_step", "schedule", "update_from_output", "output_processor", "runner_update_states",
            "runner_sample", "execute_model", "model_forward"] + ["runner_metadata"] * len(meta_fns)  # fmt: skip
    best: dict[str, float] | None = None
    try:
        for (obj, name, f), key in zip(saved, keys, strict=True):
            setattr(obj, name, _timed(acc, key, f))
        for _ in range(reps):
            core.block_manager.reset_prefix_cache()
            acc.clear()
            steps0 = core.num_steps
            t0 = _clock()
            llm.generate(prompts, params, use_tqdm=False)
            acc["total"] = _clock() - t0
            acc["steps"] = core.num_steps - steps0
            acc["python"] = acc["total"] - acc["c_step"]
            if best is None or acc["python"] < best["python"]:
                best = dict(acc)
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)
    assert best is not None
    return _parts(best, threads, stub)


def _parts(a: dict[str, float], threads: int, stub: bool) -> dict[str, Any]:
    ms = {k: 1000 * v for k, v in a.items() if k != "steps"}
    steps = int(a["steps"])
    runner_parts = ("runner_update_states", "runner_sample", "runner_metadata", "model_forward")
    engine_parts = ("schedule", "update_from_output", "output_processor", "execute_model")
    parts = {
        "schedule": ms["schedule"],
        "runner_update_states": ms["runner_update_states"],
        "runner_metadata": ms["runner_metadata"],
        "model_python": ms["model_forward"] - ms["c_step"],
        "runner_sample": ms["runner_sample"],
        "runner_rest": ms["execute_model"] - sum(ms[k] for k in runner_parts),
        "update_from_output": ms["update_from_output"],
        "output_processor": ms["output_processor"],
        "rest": ms["total"] - sum(ms[k] for k in engine_parts),
    }
    return {
        "threads": threads,
        "stub": stub,
        "steps": steps,
        "python_ms": ms["python"],
        "python_ms_per_step": ms["python"] / max(steps, 1),
        "c_step_ms": None if stub else ms["c_step"],
        "parts_ms": {k: round(v, 1) for k, v in parts.items()},
    }


def beside(model: str, workload: str, threads: int, work_ms: float, reps: int) -> dict[str, Any]:
    """Would a prepare-ahead pay? The workload's first 64-row decode step (captured from a
    short run) timed alone and while a Python thread runs `work_ms` of pure Python beside
    it, as the next step's scheduling would (the C step releases the GIL); alternated,
    medians of `reps` in ms. It pays only if `beside_ms` < `alone_ms` + `work_ms`."""
    import statistics
    import threading

    from fleetserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    reqs = load_workload(workload)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    llm = LLM(model=model, max_model_len=longest + 16, max_num_seqs=64, num_threads=threads, seed=0)
    plan = llm.engine.core.executor.runner.model.model.decode_plan  # type: ignore[attr-defined]
    run = plan.run
    kept: list[Any] = []

    class Captured(Exception):
        pass

    def capture(*args: Any) -> Any:
        out = run(*args)
        if args[0].shape[0] == 64 and int(args[5].max()) == 1:
            kept.extend(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            raise Captured  # the run is aborted: the rest is not needed
        return out

    plan.run = capture
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except Captured:
        pass
    finally:
        plan.run = run
    if not kept:
        raise ValueError("the workload has no 64-row decode step")

    def python_work() -> None:
        end, x = time.perf_counter() + work_ms / 1000, 0
        while time.perf_counter() < end:
            for i in range(200):
                x += i

    alone, with_python = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(*kept)
        alone.append(time.perf_counter() - t0)
        th = threading.Thread(target=python_work)
        t0 = time.perf_counter()
        th.start()
        run(*kept)
        with_python.append(time.perf_counter() - t0)
        th.join()
    return {
        "threads": threads,
        "work_ms": work_ms,
        "alone_ms": 1000 * statistics.median(alone),
        "beside_ms": 1000 * statistics.median(with_python),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bench Llama")
    p.add_argument("--workload", default="/work/shared/bench/workload.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stub", action="store_true", help="the C step replaced by a stand-in")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument(
        "--beside", type=float, default=None, metavar="MS",
        help="instead: a 64-row decode step alone and beside MS of Python (--reps runs)",
    )  # fmt: skip
    args = p.parse_args()
    if args.beside is not None:
        m = args.model or bench_model_path()
        print(json.dumps(beside(m, args.workload, args.threads, args.beside, args.reps), indent=1))
        return
    out = measure(
        args.model or bench_model_path(), args.workload, args.threads, args.stub, args.reps
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
