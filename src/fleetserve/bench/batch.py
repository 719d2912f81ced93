"""`fleetserve bench batch`: `fleetserve batch run` against the offline LLM ceiling.

Writes N short chat lines (seeded), runs them through `fleetserve batch run` as a
subprocess (a fresh checkpoint), then the same conversations through one
`LLM.chat(...)` call in this process, with the same engine flags and sampling. Both are
timed from the model being loaded (`batch run` reports its own run time). Greedy outputs
are compared line by line as a check that both did the same work. `--oversubscribe 1 2`
runs `batch run` once per value (in that order, before the ceiling), to compare them in
one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

_SUBJECTS = ["a colour", "an animal", "a fruit", "a country", "a planet", "a metal", "a tree"]
_ASKS = ["Name {s}.", "Give one word for {s}.", "Say {s} in one word.", "Pick {s} at random."]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--num-lines", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--oversubscribe",
        type=float,
        nargs="+",
        default=[None],
        help="batch run's --oversubscribe, one run per value (default: its own default)",
    )
    p.add_argument("--json", default=None, help="write the figures here")


def make_lines(n: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        ask = rng.choice(_ASKS).format(s=rng.choice(_SUBJECTS))
        body = {
            "messages": [{"role": "user", "content": f"#{i}. {ask}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        lines.append(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            }
        )
    return lines


def _load() -> float:
    return os.getloadavg()[0]


def run(args: argparse.Namespace) -> int:
    lines = make_lines(args.num_lines, args.max_tokens, args.seed)
    tmp = tempfile.mkdtemp(prefix="fleetserve-bench-batch-")
    try:
        inp = os.path.join(tmp, "in.jsonl")
        with open(inp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
        runs = []
        for i, factor in enumerate(args.oversubscribe):
            result = _batch_run(args, inp, os.path.join(tmp, f"out{i}.jsonl"), factor)
            if result is None:
                return 1
            runs.append(result)
        load1 = _load()
        ceiling = _ceiling(args, lines)
        load2 = _load()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    llm_s = ceiling["seconds"]
    figures: dict[str, Any] = {
        "num_lines": args.num_lines,
        "max_tokens": args.max_tokens,
        "llm_generate_s": round(llm_s, 2),
        "llm_lines_per_s": round(args.num_lines / llm_s, 1),
        "llm_out_tok_per_s": round(ceiling["tokens"] / llm_s, 1),
        "llm_engine_steps": ceiling["steps"],
        "load_1min_before_ceiling_and_after": [round(load1, 2), round(load2, 2)],
        "batch_runs": [],
    }
    for r in runs:
        texts = r.pop("texts")
        r["identical_greedy_outputs"] = sum(
            a == b for a, b in zip(texts, ceiling["texts"], strict=True)
        )
        r["ratio_of_ceiling"] = round(llm_s / r["batch_run_s"], 3)
        figures["batch_runs"].append(r)
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    return 0


def _batch_run(
    args: argparse.Namespace, inp: str, out: str, oversubscribe: float | None
) -> dict[str, Any] | None:
    """One `fleetserve batch run` subprocess over INPUT: its figures, or None if it failed."""
    engine_flags = ["--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        engine_flags += ["--model", args.model]
    if args.num_threads:
        engine_flags += ["--num-threads", str(args.num_threads)]
    if oversubscribe is not None:
        engine_flags += ["--oversubscribe", f"{oversubscribe:g}"]
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "batch", "run", inp,
           "-o", out, "--no-progress", *engine_flags]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    load0 = _load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return None
    m = re.search(r"ran (\d+) lines in ([0-9.]+) s \(.*, (\d+) engine steps\)", proc.stderr)
    if m is None:
        print(f"no run time in batch run's output:\n{proc.stderr}", file=sys.stderr)
        return None
    batch_s = float(m.group(2))
    with open(out, encoding="utf-8") as f:
        results = [json.loads(x) for x in f]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results)
    return {
        "oversubscribe": "default" if oversubscribe is None else oversubscribe,
        "batch_run_s": round(batch_s, 2),
        "engine_steps": int(m.group(3)),
        "batch_run_wall_s": round(wall_s, 2),
        "batch_lines_per_s": round(args.num_lines / batch_s, 1),
        "batch_out_tok_per_s": round(tokens / batch_s, 1),
        "load_1min_before_and_after": [round(load0, 2), round(_load(), 2)],
        "texts": [r["response"]["body"]["choices"][0]["message"]["content"] for r in results],
    }


def _ceiling(args: argparse.Namespace, lines: list[dict[str, Any]]) -> dict[str, Any]:
    from fleetserve.core.sampling_params import SamplingParams
    from fleetserve.engine.llm import LLM

    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if args.num_threads:
        kwargs["num_threads"] = args.num_threads
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    conversations = [x["body"]["messages"] for x in lines]
    t0 = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    steps = int(llm.engine.stats()["num_steps"])
    llm.engine.shutdown()
    return {
        "seconds": seconds,
        "steps": steps,
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "texts": [o.outputs[0].text for o in outs],
    }
