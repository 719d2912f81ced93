"""Where one stream's decode step goes: the C step, the worker's Python, the engine's.

`python -m fleetserve.bench.step_split [--threads T] [--model PATH] [--tokens N]` runs
one greedy stream (default: the bundled SmolLM2 GGUF) through an `LLMEngine` and
reports, per step:

- CPU ms (thread time; wall ms past one thread) inside the C step (`DecodePlan.run`,
  LM head included where the plan has one), in the rest of `ModelRunner.execute_model`
  (metadata, embedding, sampling: the worker's Python) and in the rest of
  `LLMEngine.step` (scheduler, detokenizer);
- one captured decode step replayed with the LM head inside the step against the same
  step without it followed by the module path's `compute_logits` (interleaved rounds,
  best and median), after checking that both give the same logits;
- the read bandwidth of the threads used (bench/roofline.py's probe over a buffer the
  size of the bytes a token reads, best of 10), against which bytes read per token give
  the roofline share;
- with `--phases`, one more run with the C step timing itself: wall ms per step of each
  phase (row work, each projection, attention, the LM head, the fused argmax) on each
  thread, and the projections' weight bytes per ms (GB/s). A phase that ends in the
  team's barrier includes the wait: at 2 threads the threads' differences are the waits.
  `--cpu-clock` times each thread's CPU time instead (a loaded machine's preemptions
  left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fleetserve.bench.roofline import bytes_per_token, read_bandwidth


def read_bandwidth_gbs(threads: int, megabytes: int = 100) -> float:
    """Best of 10 streaming reads of `megabytes` on `threads` threads (bench/roofline.py's
    probe: AVX-512 loads, 2 MiB pages as the step's weights); at one thread on the CPU
    clock, as the step's time is taken there."""
    p = read_bandwidth(megabytes, threads)
    return p.cpu_gbs if threads == 1 else p.best_gbs


def thread_clock(threads: int) -> Callable[[], float]:
    """One thread: the thread's CPU clock (holds on a busy machine); more: wall-clock."""
    return time.thread_time if threads == 1 else time.perf_counter


class StepTimer:
    """While installed (`with`), times one runner's C steps (`DecodePlan.run`) and its
    `execute_model` calls on `clock`, and hands each C step's arguments to `capture` (the
    input of a replay). `spent["c"]` is inside the C step, `spent["worker"]` inside
    execute_model (the C step included)."""

    def __init__(
        self,
        runner: Any,
        plan: Any,
        clock: Callable[[], float],
        capture: Callable[[tuple[Any, ...]], None] | None = None,
    ) -> None:
        self.runner, self.plan, self.clock, self.capture = runner, plan, clock, capture
        self.run, self.execute = plan.run, runner.execute_model
        self.spent = {"c": 0.0, "worker": 0.0}

    def _timed_run(self, *args: Any) -> torch.Tensor:
        if self.capture is not None:
            self.capture(args)
        t0 = self.clock()
        out = self.run(*args)
        self.spent["c"] += self.clock() - t0
        return out

    def _timed_execute(self, *args: Any) -> Any:
        t0 = self.clock()
        out = self.execute(*args)
        self.spent["worker"] += self.clock() - t0
        return out

    def __enter__(self) -> StepTimer:
        self.plan.run, self.runner.execute_model = self._timed_run, self._timed_execute
        return self

    def __exit__(self, *exc: object) -> None:
        self.plan.run, self.runner.execute_model = self.run, self.execute

    def per_step_ms(self, total: float, steps: int) -> dict[str, float]:
        """A run of `steps` engine steps that took `total` seconds: ms per step in all, in
        the C step, in the worker's Python and in the engine's."""
        c, worker = self.spent["c"], self.spent["worker"]
        return {
            "step_ms": 1000 * total / steps,
            "c_step_ms": 1000 * c / steps,
            "worker_python_ms": 1000 * (worker - c) / steps,
            "engine_python_ms": 1000 * (total - worker) / steps,
        }


def split(
    model: str | None, threads: int, tokens: int, phases: bool = False, cpu_clock: bool = False
) -> dict[str, Any]:
    from fleetserve.core.sampling_params import SamplingParams
    from fleetserve.engine.arg_utils import EngineArgs
    from fleetserve.engine.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    engine = LLMEngine(
        EngineArgs(model=model, num_threads=threads, max_num_seqs=1, max_model_len=tokens + 64)
    )
    runner = engine.core.executor.runner  # type: ignore[attr-defined]
    # One C step per engine step, so that the split is per token: a burst's extra tokens
    # (worker/decode_burst.py) would run inside one step's worker time (bench latency
    # times the stream with them).
    runner.burst = None
    plan = runner.model.model.decode_plan
    if plan is None:
        raise ValueError("this model has no C step here (FLEETSERVE_FUSED_DECODE=0?)")
    saved: list[list[Any]] = []

    def capture(args: tuple[Any, ...]) -> None:
        if len(saved) < tokens // 2:
            saved.append(list(args))

    prompt = {"prompt_token_ids": list(range(100, 128))}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    steps = []
    clock = thread_clock(threads)
    lead0, chunks0 = plan.lead_steps, plan.lead_chunks
    for i in range(2):  # the first run warms up
        saved.clear()
        with StepTimer(runner, plan, clock, capture) as timer:
            engine.add_request(f"split-{i}", prompt, params)
            n, t0 = 0, clock()
            while engine.has_unfinished_requests():
                engine.step()
                n += 1
            total = clock() - t0
        steps.append({"steps": n, **timer.per_step_ms(total, n)})
    replay = _replay_head(runner.model, plan.run, saved[-1], clock)
    # Steps run on one thread, the others idle or streaming (decode_step.c's lead steps).
    lead = plan.lead_steps - lead0
    out = {"threads": threads, "lead_steps": lead, "split": steps[-1], "head_replay": replay}
    # Chunks of the shared projections' weight rows each thread of the lead steps took.
    out["lead_chunks"] = [b - a for a, b in zip(chunks0, plan.lead_chunks, strict=True)]
    # Bytes a decode step reads: every projection's and the head's weights, and the KV
    # cache at the run's mean context.
    mean_ctx = len(prompt["prompt_token_ids"]) + tokens / 2
    token_bytes = bytes_per_token(engine, mean_ctx) or 0.0
    out["bytes_per_token_mb"] = round(token_bytes / 1e6, 2)
    if phases:
        out["phases"] = _phases(engine, plan, threads, prompt, params, cpu_clock)
    engine.shutdown()
    return out


def _phases(
    engine: Any, plan: Any, threads: int, prompt: Any, params: Any, cpu_clock: bool = False
) -> dict[str, Any]:
    """One more run with the C step's own phase timing: ms per step per thread, GB/s
    (`cpu_clock`: each thread's CPU time, else wall)."""
    plan.start_profile(threads, cpu=cpu_clock)
    steps0 = plan.steps
    engine.add_request("split-phases", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    n = plan.steps - steps0
    secs = plan.stop_profile()
    ms = {name: [round(1000 * s / n, 4) for s in v] for name, v in secs.items()}
    gbs = {
        name: round(plan.weight_bytes[name] / (max(secs[name]) / n) / 1e9, 2)
        for name in secs
        if plan.weight_bytes[name] and max(secs[name]) > 0
    }
    return {
        "steps": n,
        "ms_per_step": ms,
        "total_ms_per_step": [round(sum(v[t] for v in ms.values()), 4) for t in range(threads)],
        "weight_mb": {k: round(v / 1e6, 2) for k, v in plan.weight_bytes.items() if v},
        "weight_gbs": gbs,
    }


def _replay_head(
    model: Any, run: Callable[..., torch.Tensor], args: list[Any], clock: Callable[[], float]
) -> dict[str, float]:
    """A decode step with the head inside vs without it + compute_logits, in ms."""
    if len(args) < 12 or args[10] is None:  # no head in the step (or a tree before it)
        return {}
    rows, logits = args[10], args[11]
    bare = args[:10] + [None, None]

    def inside() -> torch.Tensor:
        run(*args)
        return logits

    def outside() -> torch.Tensor:
        return model.compute_logits(run(*bare)[rows])

    if not torch.equal(model.finish_logits(inside()), outside()):
        raise AssertionError("the head inside the step and compute_logits disagree")
    times: dict[str, list[float]] = {"inside": [], "outside": []}
    for _ in range(5):
        for name, f in (("inside", inside), ("outside", outside)):
            t0 = clock()
            for _ in range(20):
                f()
            times[name].append(1000 * (clock() - t0) / 20)
    return {
        f"{name}_{stat}_ms": fn(v)
        for name, v in times.items()
        for stat, fn in (("best", min), ("median", statistics.median))
    }


def emit(out: dict[str, Any], json_path: str | None) -> None:
    """A split's figures: printed as JSON, and written to `json_path` when given."""
    print(json.dumps(out, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--json", default=None)
    p.add_argument("--phases", action="store_true", help="also time the C step's phases")
    p.add_argument(
        "--cpu-clock", action="store_true", help="phases in each thread's CPU time, not wall"
    )
    args = p.parse_args()
    out = split(args.model, args.threads, args.tokens, args.phases, args.cpu_clock)
    out["read_gbs"] = read_bandwidth_gbs(args.threads, max(8, round(out["bytes_per_token_mb"])))
    # Step time: CPU time at 1 thread (what the step costs, whatever else runs), wall
    # time past it.
    gbs = out["bytes_per_token_mb"] / out["split"]["step_ms"]
    out["roofline"] = {"step_gbs": round(gbs, 2), "share": round(gbs / out["read_gbs"], 3)}
    emit(out, args.json)


if __name__ == "__main__":
    main()
