"""Where a served run's engine time goes: the 16-client chat workload, step by step.

`python -m fleetserve.bench.served_split [--threads T] [--seed S] [--concurrency C]`
runs the prompts `fleetserve bench serve --endpoint chat --num-prompts 48 --input-len
64:128 --output-len 64:128 --seed S` sends (the same words, through the model's chat
template, greedy, EOS honoured) through an in-process engine holding at most C
sequences (the clients' limit: a finished request's slot is refilled at the next step,
as a waiting client's next request would be; no HTTP). Per step kind (decode: one row
per sequence; mixed: prompt chunks beside decodes; prefill: prompt rows only) and rows
it reports steps, ms per step inside the C step (`DecodePlan.run`, LM head included),
the worker's and the engine's Python, and the C step's own phase timing (wall ms per
step on thread 0, which ends each phase in the team's barrier): row-wise work, each
projection (the GGUF's layer format), attention, the LM head (its format) and argmax.

One thread (`--threads 1`) times with the thread's CPU clock: figures that hold on a
busy machine. More threads time wall-clock.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any

import torch

from fleetserve.bench.serve import synthetic_prompts
from fleetserve.kernels.decode_step import PHASES


def _kind(q_lens: torch.Tensor) -> tuple[str, int]:
    decodes = int((q_lens == 1).sum())
    kind = "decode" if decodes == q_lens.shape[0] else "prefill" if decodes == 0 else "mixed"
    return kind, decodes


def _bucket(kind: str, rows: int) -> str:
    if kind == "decode":
        return f"decode {rows}"
    lo = 1 << max(0, (rows - 1).bit_length() - 1)
    return f"{kind} {lo}-{2 * lo - 1}"


def split(
    model: str | None,
    threads: int,
    seed: int,
    concurrency: int,
    num_prompts: int = 48,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int | None = None,
) -> dict[str, Any]:
    from fleetserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(
        model=model,
        max_num_seqs=concurrency,
        num_threads=threads,
        seed=0,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    engine, core = llm.engine, llm.engine.core
    runner = core.executor.runner  # type: ignore[attr-defined]
    plan = runner.model.model.decode_plan
    if plan is None:
        raise ValueError("this model has no C step here (FLEETSERVE_FUSED_DECODE=0?)")
    tok = llm.get_tokenizer()
    prompts = synthetic_prompts(num_prompts, seed, (64, 128), (64, 128))
    ids = [tok.apply_chat_template([{"role": "user", "content": p.prompt}], True) for p in prompts]
    clock = time.thread_time if threads == 1 else time.perf_counter
    cur: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    run, execute, engine_step = plan.run, runner.execute_model, engine.step

    def timed_run(*args: Any) -> Any:
        plan.start_profile(1)
        t0 = clock()
        out = run(*args)
        cur["c"] = cur.get("c", 0.0) + clock() - t0
        prof = plan.stop_profile()
        kind, decodes = _kind(args[5])
        cur.update(kind=kind, rows=args[0].shape[0], decodes=decodes)
        cur["phases"] = {k: v[0] for k, v in prof.items()}
        return out

    def timed_execute(*args: Any) -> Any:
        t0 = clock()
        out = execute(*args)
        cur["runner"] = cur.get("runner", 0.0) + clock() - t0
        return out

    def timed_engine_step() -> Any:
        cur.clear()
        t0 = clock()
        out = engine_step()
        cur["engine"] = clock() - t0
        steps.append(dict(cur))
        return out

    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens) for p in prompts]
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2), use_tqdm=False)
    core.block_manager.reset_prefix_cache()
    plan.run, runner.execute_model, engine.step = timed_run, timed_execute, timed_engine_step
    t0 = clock()
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    total = clock() - t0
    plan.run, runner.execute_model, engine.step = run, execute, engine_step
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in steps:
        if "kind" not in s:
            continue
        for key in (_bucket(s["kind"], s["rows"]), f"all {s['kind']}", "all"):
            g = groups[key]
            g["steps"] += 1
            g["rows"] += s["rows"]
            g["decode_rows"] += s["decodes"]
            g["c_s"] += s["c"]
            g["runner_python_s"] += s.get("runner", 0.0) - s["c"]
            g["engine_python_s"] += s["engine"] - s.get("runner", 0.0)
            for name in PHASES:
                g[f"{name}_s"] += s["phases"][name]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "threads": threads,
        "seed": seed,
        "concurrency": concurrency,
        "total_s": total,
        "prompt_tokens": sum(len(i) for i in ids),
        "output_tokens": out_tokens,
        "kv_cache_dtype": kv_cache_dtype,
        "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
        "engine_steps_s": sum(s["engine"] for s in steps),
        "groups": {k: dict(v) for k, v in sorted(groups.items(), key=lambda kv: kv[0])},
    }


def table(out: dict[str, Any]) -> str:
    """Markdown: per group, steps, mean rows and ms per step (C step phases, Python)."""
    cols = ["rows", *PHASES]
    head = "| steps group | steps | rows/step | C ms | " + " | ".join(cols[1:]) + " | Python ms |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for name, g in out["groups"].items():
        n = g["steps"]
        py = 1000 * (g["runner_python_s"] + g["engine_python_s"]) / n
        cells = [f"{1000 * g[f'{p}_s'] / n:.2f}" for p in PHASES]
        lines.append(
            f"| {name} | {int(n)} | {g['rows'] / n:.1f} | {1000 * g['c_s'] / n:.2f} | "
            + " | ".join(cells)
            + f" | {py:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 1024")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = split(
        args.model, args.threads, args.seed, args.concurrency, args.num_prompts,
        args.kv_cache_dtype, args.max_num_batched_tokens,
    )  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if k != "groups"}, indent=1))
    print(table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
