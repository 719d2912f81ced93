"""Where an offline run's time goes: each engine step by kind, and what its C step spends.

`python -m fleetserve.bench.offline_split [--workload PATH] [--threads T] [--model PATH]`
runs a workload (as `fleetserve bench offline`: greedy, ignore_eos) through `LLM.generate`
and reports:

- per step kind (prefill: only prompt rows; mixed: prompt chunks beside decodes; decode:
  one row per sequence): steps, rows, seconds inside the C step (`DecodePlan.run`, LM head
  included), in the rest of the runner (metadata, sampling: the worker's Python), in the
  engine core's and the engine's Python (scheduler, detokenizer);
- decode steps by rows (buckets of 8): ms per step;
- the biggest mixed step and the widest decode step replayed (`--replay`, bf16 or float32
  weights of a plan whose projections are plain `Linear`s): the whole step against its
  projections' GEMMs alone, the LM head alone and its attention alone (best of N each),
  the rest being row-wise work and barriers.

One thread (`--threads 1`) times with the thread's CPU clock: figures that hold on a busy
machine. More threads time wall-clock, and add what the kernel's scheduler saw
(bench/thread_stats.py): each thread's CPU and run-queue time over the run, and per step
kind the team's worker threads' CPU time inside the C step against the step's wall time
(the rest: asleep at a barrier, woken late, or pushed off the core), their futex sleeps
(voluntary switches) inside and between steps, and a timeline of the first steps of each
kind (ms from the run's start).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from fleetserve.bench.offline import bench_model_path
from fleetserve.bench.step_split import emit, thread_clock
from fleetserve.bench.thread_stats import ThreadSample, main_tid, sample_all, sample_thread, since
from fleetserve.bench.workloads import load_workload


def _kind(q_lens: torch.Tensor) -> str:
    decodes = int((q_lens == 1).sum())
    if decodes == q_lens.shape[0]:
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


def split(
    model: str,
    workload: str,
    threads: int,
    max_num_batched_tokens: int | None = None,
    bf16_weights: bool | None = None,
) -> dict[str, Any]:
    """The figures above for `workload` (a JSON file shaped like shared/bench/workload.json).
    bf16_weights: as LLM's (None: as `--dtype auto` picks)."""
    from fleetserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    reqs = load_workload(workload)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    llm = LLM(
        model=model,
        max_model_len=longest + 16,
        max_num_seqs=64,
        max_num_batched_tokens=max_num_batched_tokens,
        num_threads=threads,
        seed=0,
        bf16_weights=bf16_weights,
    )
    engine, core = llm.engine, llm.engine.core
    runner = core.executor.runner  # type: ignore[attr-defined]
    plan = runner.model.model.decode_plan
    if plan is None:
        raise ValueError("this model has no C step here (FLEETSERVE_FUSED_DECODE=0?)")
    clock = thread_clock(threads)
    cur: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    kept: dict[str, list[Any]] = {}
    run, execute, core_step, engine_step = plan.run, runner.execute_model, core.step, engine.step

    workers: list[int] = []  # the team's other threads (found after the warm-up)

    def worker_sample() -> list[ThreadSample]:
        """The workers', then (last) this thread's counters."""
        return [w for w in (sample_thread(t) for t in [*workers, main_tid()]) if w is not None]

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any) -> Any:
            if name == "c" and workers:
                cur["w0"] = worker_sample()
                cur["t_c0"] = time.perf_counter()
            split0 = plan.split_steps
            t0 = clock()
            out = f(*args)
            cur[name] = cur.get(name, 0.0) + clock() - t0
            if name == "c":
                cur["split"] = cur.get("split", 0) + plan.split_steps - split0
            if name == "c" and workers:
                cur["t_c1"] = time.perf_counter()
                cur["w1"] = worker_sample()
            if name == "c":
                kind, m = _kind(args[5]), args[0].shape[0]
                cur.update(kind=kind, rows=m, ctx=int(args[6].sum()))
                key = "mixed" if kind != "decode" else "decode"
                if m >= kept.get(key, [torch.empty(0)])[0].shape[0]:
                    kept[key] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            return out

        return inner

    def timed_engine_step() -> Any:
        cur.clear()
        cur["t0"] = time.perf_counter()
        out = timed("engine", engine_step)()
        cur["t1"] = time.perf_counter()
        if workers:
            cur["w_end"] = worker_sample()
        steps.append(dict(cur))
        return out

    plan.run, runner.execute_model = timed("c", run), timed("runner", execute)
    core.step, engine.step = timed("core", core_step), timed_engine_step
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs
    ]
    warm = SamplingParams(max_tokens=2)
    before = sample_all()
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], warm, use_tqdm=False)
    if threads > 1:
        # The team's workers: the threads other than this one that ran during the warm-up
        # (its steps are the only parallel work so far).
        me = main_tid()
        workers.extend(d.tid for d in since(before, sample_all()) if d.tid != me and d.cpu_s)
    core.block_manager.reset_prefix_cache()
    steps.clear()
    kept.clear()
    before = sample_all()
    t_start = time.perf_counter()
    t0 = clock()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    total = clock() - t0
    by_thread = since(before, sample_all())
    plan.run, runner.execute_model, core.step, engine.step = run, execute, core_step, engine_step
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    buckets: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        c = kinds[s.get("kind", "none")]
        c["steps"] += 1
        c["rows"] += s.get("rows", 0)
        c["c_step_s"] += s.get("c", 0.0)
        c["split_steps"] += s.get("split", 0)  # ran as one sub-step per thread
        c["runner_python_s"] += s.get("runner", 0.0) - s.get("c", 0.0)
        c["engine_python_s"] += s.get("engine", 0.0) - s.get("runner", 0.0)
        if s.get("kind") == "decode":
            buckets[s["rows"] // 8 * 8].append(s["c"])
    out: dict[str, Any] = {
        "threads": threads,
        "total_s": total,
        "kinds": {k: dict(v) for k, v in kinds.items()},
        "decode_ms_by_rows": {
            f"{b}-{b + 7}": 1000 * sum(v) / len(v) for b, v in sorted(buckets.items())
        },
        "replay": {k: replay(runner.model, run, a, clock) for k, a in kept.items()},
    }
    if workers:
        out["threads_over_run"] = [
            {
                "tid": d.tid,
                "main": d.tid == main_tid(),
                "cpu_s": round(d.cpu_s, 3),
                "runqueue_s": round(d.runqueue_s, 3),
                "voluntary": d.voluntary,
                "involuntary": d.involuntary,
            }
            for d in by_thread
            if d.cpu_s > 0.01 or d.tid in workers or d.tid == main_tid()
        ]
        out["team"] = team_split(steps, t_start, len(workers))
    return out


def team_split(
    steps: list[dict[str, Any]], t_start: float, num_workers: int, timeline: int = 3
) -> dict[str, Any]:
    """Per step kind, what the workers did (summed over them; see the module's docstring),
    and the first `timeline` steps of each kind."""
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    lines: dict[str, list[dict[str, float]]] = defaultdict(list)
    prev_end: list[ThreadSample] | None = None
    for s in steps:
        if "w0" not in s:
            prev_end = s.get("w_end")
            continue
        w0, w1 = s["w0"], s["w1"]
        both = [b.minus(a) for a, b in zip(w0, w1, strict=True)]
        inside, me = both[:-1], both[-1]
        c = kinds[s["kind"]]
        c["main_cpu_in_c_s"] += me.cpu_s
        c["main_sleeps_in_c"] += me.voluntary
        c["steps"] += 1
        c["c_wall_s"] += s["t_c1"] - s["t_c0"]
        c["engine_wall_s"] += s["t1"] - s["t0"]
        c["worker_cpu_in_c_s"] += sum(d.cpu_s for d in inside)
        c["worker_runqueue_in_c_s"] += sum(d.runqueue_s for d in inside)
        c["worker_sleeps_in_c"] += sum(d.voluntary for d in inside)
        c["worker_preempted_in_c"] += sum(d.involuntary for d in inside)
        if prev_end is not None:
            # From the previous step's end to this C step's start: the serial Python.
            between = [b.minus(a) for a, b in zip(prev_end[:-1], w0[:-1], strict=True)]
            c["worker_cpu_between_s"] += sum(d.cpu_s for d in between)
            c["worker_sleeps_between"] += sum(d.voluntary for d in between)
        prev_end = s["w_end"]
        if len(lines[s["kind"]]) < timeline:
            lines[s["kind"]].append(
                {
                    "rows": s["rows"],
                    "step_ms_from_start": round(1000 * (s["t0"] - t_start), 2),
                    "python_before_c_ms": round(1000 * (s["t_c0"] - s["t0"]), 3),
                    "c_ms": round(1000 * (s["t_c1"] - s["t_c0"]), 3),
                    "python_after_c_ms": round(1000 * (s["t1"] - s["t_c1"]), 3),
                    "worker_cpu_in_c_ms": round(1000 * sum(d.cpu_s for d in inside), 3),
                    "worker_sleeps_in_c": sum(d.voluntary for d in inside),
                    "main_cpu_in_c_ms": round(1000 * me.cpu_s, 3),
                }
            )
    out: dict[str, Any] = {}
    for k, c in kinds.items():
        d = {n: round(v, 4) if isinstance(v, float) else v for n, v in c.items()}
        idle = num_workers * c["c_wall_s"] - c["worker_cpu_in_c_s"]
        d["worker_idle_in_c_s"] = round(idle, 4)
        d["serial_s"] = round(c["engine_wall_s"] - c["c_wall_s"], 4)
        out[k] = d
    out["timeline"] = dict(lines)
    return out


def _best(f: Callable[[], Any], clock: Callable[[], float], reps: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        f()
        best = min(best, clock() - t0)
    return 1000 * best


def replay(
    model: Any, run: Callable[..., torch.Tensor], args: list[Any], clock: Callable[[], float]
) -> dict[str, float]:
    """One captured step (run's arguments) in ms: whole, its GEMMs, head and attention
    alone; {} when its projections are not plain bf16 / float32 `Linear`s."""
    from fleetserve.kernels import cpu
    from fleetserve.kernels.bf16 import gemm_bf16
    from fleetserve.kernels.decode_step import _lib

    def cpu_max_rows() -> int:
        return int(_lib().decode_step_max_rows())

    layers = model.decoder_layers()
    projs = [
        (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for a, mlp in ((d.self_attn, d.mlp) for d in layers)
    ]
    if any(getattr(p, "bf16", None) is None for ps in projs for p in ps):
        return {}
    m, nr = args[0].shape[0], 0 if args[10] is None else args[10].shape[0]
    # A wide step asked for its sampled rows only runs the last layer's o projection and
    # MLP on those rows (decode_step.c's prune): the GEMMs replayed as it runs them.
    pruned = len(args) > 13 and bool(args[13]) and m > cpu_max_rows() and nr < m
    last_rows = nr if pruned else m
    xs = {p.bf16.shape[1]: torch.randn(m, p.bf16.shape[1]) for p in projs[0]}
    head = getattr(model.lm_head, "bf16", None) if model.lm_head is not None else None

    def gemms() -> None:
        for i, ps in enumerate(projs):
            for j, p in enumerate(ps):
                x = xs[p.bf16.shape[1]]
                if i == len(projs) - 1 and j > 0:
                    if not last_rows:
                        continue
                    x = x[:last_rows]
                gemm_bf16(x, p.bf16)

    attn0 = layers[0].self_attn
    q = torch.randn(m, attn0.num_heads, attn0.head_dim)
    o = torch.empty_like(q)

    def attention() -> None:
        for d in layers:
            at = d.self_attn.attn
            q_starts, q_lens, seq_lens, tables = args[4:8]
            cpu.paged_attention(
                q, at.k_cache, at.v_cache, o, q_starts, q_lens, seq_lens, tables,
                at.k_cache.shape[-1], at.scale,
            )  # fmt: skip

    out = {
        "rows": float(m),
        "step_ms": _best(lambda: run(*args), clock),
        "gemm_ms": _best(gemms, clock),
        "attention_ms": _best(attention, clock),
    }
    if head is not None and nr:
        xh = torch.randn(nr, head.shape[1])
        out["head_ms"] = _best(lambda: gemm_bf16(xh, head), clock)
    out["rest_ms"] = out["step_ms"] - out["gemm_ms"] - out["attention_ms"] - out.get("head_ms", 0)
    flops = 2 * m * sum(p.bf16.numel() for ps in projs for p in ps)
    flops -= 2 * (m - last_rows) * sum(p.bf16.numel() for p in projs[-1][1:])
    out["gemm_tflops"] = flops / out["gemm_ms"] / 1e9
    out["last_layer_rows"] = float(last_rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bench Llama")
    p.add_argument("--workload", default="/work/shared/bench/workload.json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = split(
        args.model or bench_model_path(), args.workload, args.threads, args.max_num_batched_tokens
    )
    emit(out, args.json)


if __name__ == "__main__":
    main()
