"""`python -m fleetserve.bench.structured`: the cost of structured outputs per decode step.

One engine, the same chat prompts with and without a realistic JSON schema (an order:
nested object, an array of items with patterns, enums and numeric ranges). Runs
alternate (free, constrained, free, ...) so machine load hits both alike. Reported per
run: the mean decode step time while every stream of the run is still decoding (so a
constrained stream that finishes early does not shrink the batch being measured), that
is TPOT at 1 stream and tokens/s = streams / step time at N streams; the process CPU time
per step (all threads: steadier than wall time on a shared machine); and the mask's own
time per step (filled on the mask thread while the forward pass runs).

    fleetserve bench structured --streams 1 16 --rounds 3

With `--compare fleetserve vllm llamacpp` the same comparison runs served, against the
peers (bench/structured_peers.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.structured import StructuredOutputsParams
from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "name": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number", "minimum": 0, "maximum": 10000},
                },
                "required": ["sku", "name", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 200},
    },
    "required": ["order_id", "customer", "items", "express", "notes"],
    "additionalProperties": False,
}
PROMPT = "Write the JSON of a large order ({i}) with many items for a hardware store."


def run_once(engine: Any, streams: int, max_tokens: int, constrained: bool) -> dict[str, float]:
    so = StructuredOutputsParams(json=ORDER_SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained, structured_outputs=so
    )
    tok = engine.tokenizer
    stats0 = engine.stats()
    for i in range(streams):
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT.format(i=i)}])
        engine.add_request(f"r{i}-{time.monotonic_ns()}", {"prompt_token_ids": ids}, params)
    step_times: list[float] = []
    cpu_times: list[float] = []  # process CPU time (all threads): steadier on a busy box
    decoding = 0
    num_tokens = 0
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        sched = engine.core.scheduler
        num_tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)  # deltas
        # Decode steps with every stream still in: all have their first token.
        if decoding == streams and sched.num_running == streams:
            step_times.append(dt)
            cpu_times.append(dc)
        decoding = sched.num_running if not sched.num_waiting else 0
    stats1 = engine.stats()
    mask_steps = stats1.structured_mask_steps - stats0.structured_mask_steps
    mask_s = stats1.structured_mask_seconds - stats0.structured_mask_seconds
    step = statistics.mean(step_times) if step_times else float("nan")
    return {
        "step_ms": 1e3 * step,
        "cpu_ms": 1e3 * statistics.mean(cpu_times) if cpu_times else float("nan"),
        "tok_s": streams / step,
        "steps_measured": len(step_times),
        "mask_ms_per_step": 1e3 * mask_s / mask_steps if mask_steps else 0.0,
        "tokens": num_tokens,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from fleetserve.bench.structured_peers import add_peer_args

    add_engine_args(parser)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_peer_args(parser)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        from fleetserve.bench.structured_peers import run_peers

        return run_peers(args)
    from fleetserve.engine.llm_engine import LLMEngine

    llm = LLMEngine(engine_args_from(args))
    run_once(llm, 2, 8, True)  # warm-up: kernels, tokenizer tables, first grammar
    for n in args.streams:
        runs: dict[str, list[dict[str, float]]] = {"free": [], "json_schema": []}
        for _ in range(args.rounds):
            runs["free"].append(run_once(llm, n, args.max_tokens, False))
            runs["json_schema"].append(run_once(llm, n, args.max_tokens, True))
        summary: dict[str, Any] = {
            k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()
        }
        free, con = summary["free"]["step_ms"], summary["json_schema"]["step_ms"]
        summary["slowdown"] = con / free - 1.0
        cfree, ccon = summary["free"]["cpu_ms"], summary["json_schema"]["cpu_ms"]
        summary["cpu_slowdown"] = ccon / cfree - 1.0
        print(json.dumps({f"{n}_streams": summary}), flush=True)
    llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
