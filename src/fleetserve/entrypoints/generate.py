"""`fleetserve generate "PROMPT"`: one chat answer offline, on the default model by default."""

from __future__ import annotations

import argparse
import time

from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (or raw text with --no-chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="skip the chat template")
    p.add_argument("--system", default=None, help="optional system message")
    add_engine_args(p)
    # One request: a KV cache sized for one sequence at full length, not the serving
    # default of 64 (the cache is allocated and faulted in at start-up).
    p.set_defaults(max_num_seqs=1)


def run(args: argparse.Namespace) -> int:
    from fleetserve.core.sampling_params import SamplingParams
    from fleetserve.engine.llm_engine import LLMEngine

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed if args.temperature > 0 else None,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args_from(args))
    load_s = time.perf_counter() - t0
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt: object = {"prompt_token_ids": engine.tokenizer.apply_chat_template(messages)}
    else:
        prompt = args.prompt
    engine.add_request("0", prompt, params)  # type: ignore[arg-type]
    t1 = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas: the new text and tokens of each step
            for c in out.outputs:
                print(c.text, end="", flush=True)
                num_tokens += len(c.token_ids)
    gen_s = time.perf_counter() - t1
    print()
    print(
        f"[{num_tokens} tokens in {gen_s:.2f} s ({num_tokens / max(gen_s, 1e-9):.1f} tok/s); "
        f"load {load_s:.1f} s]",
        flush=True,
    )
    engine.shutdown()
    return 0
