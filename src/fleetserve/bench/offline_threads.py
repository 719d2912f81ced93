"""Each thread's time on the CPU over an offline run: how evenly the C step's team shares
its work, in a figure that other processes' load does not move.

`OMP_WAIT_POLICY=passive python -m fleetserve.bench.offline_threads [--workload PATH]
[--threads 2]` runs a workload (as `fleetserve bench offline`: greedy, ignore_eos)
through `LLM.generate` and prints, per thread of the process that ran more than 50 ms,
its on-CPU seconds over the run (`/proc/self/task/*/schedstat`). With passive waiting a
thread that waits at a barrier sleeps, so an uneven split shows as the OpenMP master (the
main thread, which also runs the serial Python) above the workers; on a quiet machine the
wall time is about the master's figure. Time waiting for a core under load is not in it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from fleetserve.bench.offline import bench_model_path
from fleetserve.bench.workloads import load_workload


def on_cpu() -> dict[int, tuple[str, int]]:
    """Thread id -> (name, ns on the CPU so far) for every thread of this process."""
    out = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[int(task.name)] = (name, ns)
    return out


def run(model: str, workload: str, threads: int) -> tuple[float, list[tuple[float, int, str]]]:
    """(wall seconds, [(on-CPU seconds, thread id, name)] busiest first) for `workload`."""
    from fleetserve import LLM, SamplingParams

    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    reqs = load_workload(workload)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    llm = LLM(model=model, max_model_len=longest + 16, max_num_seqs=64, num_threads=threads, seed=0)
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs
    ]
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.core.block_manager.reset_prefix_cache()
    before, t0 = on_cpu(), time.perf_counter()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    after, wall = on_cpu(), time.perf_counter() - t0
    rows = [
        ((ns - before.get(tid, (name, 0))[1]) / 1e9, tid, name) for tid, (name, ns) in after.items()
    ]
    return wall, sorted(rows, reverse=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bench Llama")
    p.add_argument("--workload", default="/work/shared/bench/workload.json")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    wall, rows = run(args.model or bench_model_path(), args.workload, args.threads)
    busy = [
        f"{name}{' (main)' if tid == os.getpid() else ''} {s:.2f} s"
        for s, tid, name in rows
        if s > 0.05
    ]
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"wall {wall:.1f} s (OMP_WAIT_POLICY {policy}); on the CPU: {', '.join(busy)}")


if __name__ == "__main__":
    main()
