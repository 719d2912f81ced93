"""`fleetserve bench kv-window`: the K/V memory one long conversation holds, with and
without freeing the blocks that slid out of the sliding-window layers' window.

One request of ``--num-prompt-tokens`` tokens (the bench's English text, repeated) that
generates ``--num-tokens`` more, run to the end in an engine of its own, once with
``free_window_blocks`` on and once off. After every step the blocks in use are counted
in each pool; the figures are the peak (a prefill chunk's window blocks included) and
the peak once decoding, in bytes: blocks x block_size x layers of that pool
x K and V x kv heads x head_dim x element size. Greedy tokens of the two runs must agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from

TEXT = Path(__file__).with_name("data") / "english.txt"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--num-prompt-tokens", type=int, default=4000)
    p.add_argument("--num-tokens", type=int, default=96, help="tokens to generate")
    p.add_argument("--json", default=None, help="write the figures here")


def measure(args: argparse.Namespace, free: bool) -> dict[str, Any]:
    from fleetserve.core.request import Request
    from fleetserve.core.sampling_params import SamplingParams
    from fleetserve.engine.core import EngineCore
    from fleetserve.tokenizer import Tokenizer

    total = args.num_prompt_tokens + args.num_tokens
    ea = dataclasses.replace(engine_args_from(args), free_window_blocks=free)
    if ea.max_model_len is None:
        ea.max_model_len = total + 16
    if ea.num_kv_blocks is None:
        ea.num_kv_blocks = -(-total // ea.block_size) + 4  # one conversation's worth
    config, source = ea.resolve()
    tok = Tokenizer.from_source(source)
    ids: list[int] = []
    text = TEXT.read_text(encoding="utf-8")
    while len(ids) < args.num_prompt_tokens:
        ids += tok.encode(text)
    ids = ids[: args.num_prompt_tokens]
    core = EngineCore(config, source)
    mcfg = config.model
    per_layer_block = (
        2 * mcfg.num_key_value_heads * mcfg.head_dim * ea.block_size * mcfg.dtype.itemsize
    )
    num_windowed = sum(1 for w in mcfg.layer_windows if w)
    bm = core.block_manager
    sliding = getattr(bm, "sliding", None)
    # Layers per pool: the hybrid's global pool serves the full-attention layers only.
    main_layers = mcfg.num_hidden_layers - (num_windowed if sliding is not None else 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.num_tokens, ignore_eos=True)
    core.add_request(Request("conv", ids, params))
    peak, decode_peak, out_ids = 0, 0, []
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        for out in core.step():
            out_ids += out.new_token_ids
        used = (bm.num_blocks - bm.num_free_blocks) * main_layers
        if sliding is not None:
            used += (sliding.num_blocks - sliding.num_free_blocks) * num_windowed
        peak = max(peak, used * per_layer_block)
        if len(out_ids) > 1:  # decode steps only: what a long conversation holds then
            decode_peak = max(decode_peak, used * per_layer_block)
    return {
        "free_window_blocks": free,
        "num_tokens": len(ids) + len(out_ids),
        "peak_kv_bytes": peak,
        "decode_peak_kv_bytes": decode_peak,
        "seconds": time.perf_counter() - t0,
        "output_token_ids": out_ids,
    }


def run(args: argparse.Namespace) -> int:
    runs = [measure(args, free) for free in (True, False)]
    if runs[0]["output_token_ids"] != runs[1]["output_token_ids"]:
        raise RuntimeError("freeing window blocks changed the greedy tokens")
    for r in runs:
        print(
            f"free_window_blocks={r['free_window_blocks']!s:5}: peak K/V "
            f"{r['peak_kv_bytes'] / 2**20:8.1f} MiB (while decoding "
            f"{r['decode_peak_kv_bytes'] / 2**20:.1f} MiB) for {r['num_tokens']} tokens "
            f"({r['seconds']:.1f} s)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "output_token_ids"} for r in runs], f)
    return 0
