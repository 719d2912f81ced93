"""`fleetserve bench moe`: one MoE layer's step against the dense MLP of equal active size.

The MoE block of the bench Mixtral (hidden 768, 8 experts of 1024, top-2: `make-model
--arch mixtral --size bench`) and the dense MLP of the bench Llama (intermediate 2048 =
2 x 1024, the same parameters active per token), random weights, both packed for the C
GEMM as the engine packs them. Each is timed at decode-sized batches (1, 8, 32 tokens)
and prefill-sized ones (512); wall time per call, the median of 5 runs, MoE and dense
alternating so that a change of machine load falls on both. The torch reference of the
grouped experts (`--torch`) shows what the C kernel buys.

What to expect: a decode batch of m tokens touches up to min(8, 2m) experts, so the
MoE layer streams up to 4x the dense layer's weights (memory-bound: slower), and at one
token the same bytes plus the routing; at prefill sizes both do the same FLOPs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="1,8,32,512", help="comma-separated batch sizes")
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate-size", type=int, default=1024)
    p.add_argument(
        "--layers",
        type=int,
        default=12,
        help="layers run one after another, each with its own weights (the bench models' 12: "
        "more weights than a large L3 keeps, as in a real step)",
    )
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    p.add_argument("--torch", action="store_true", help="also time the torch reference")
    p.add_argument("--json", default=None, help="write the figures here")


def _median_time(
    step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_time: float
) -> float:
    step(x)
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_time or calls < 3:
        step(x)
        calls += 1
    return elapsed / calls


def _blocks(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    from fleetserve.config import ModelConfig
    from fleetserve.models.llama import LlamaMLP
    from fleetserve.models.moe import SparseMoeBlock
    from fleetserve.moe_config import MoEConfig

    h, inter, e = args.hidden_size, args.expert_intermediate_size, args.num_experts
    cfg = ModelConfig(
        architecture="MixtralForCausalLM", vocab_size=32, hidden_size=h,
        intermediate_size=args.top_k * inter, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=h, rms_norm_eps=1e-6, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=16, tie_word_embeddings=False,
        attention_bias=False, qk_norm=False, dtype_name="float32", max_model_len=16,
    )  # fmt: skip
    moe_cfg = MoEConfig(e, args.top_k, inter, True, None, (0,))
    moe, dense = SparseMoeBlock(cfg, moe_cfg), LlamaMLP(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (moe, dense):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return moe, dense


def _stack(layers: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    return step


def run(args: argparse.Namespace) -> int:
    from fleetserve.layers.linear import pack_linears
    from fleetserve.models.moe import SparseMoeBlock

    torch.set_num_threads(args.num_threads)
    moes: list[torch.nn.Module] = []
    denses: list[torch.nn.Module] = []
    refs: list[torch.nn.Module] = []
    for _ in range(args.layers):
        moe_layer, dense_layer = _blocks(args)
        assert isinstance(moe_layer, SparseMoeBlock)
        if args.torch:
            refs.append(_blocks(args)[0])
        pack_linears(moe_layer)
        moe_layer.experts.pack_for_cpu()
        pack_linears(dense_layer)
        moes.append(moe_layer)
        denses.append(dense_layer)
    moe, dense = _stack(moes), _stack(denses)
    reference = _stack(refs) if refs else None
    gate = moes[0].gate
    assert isinstance(gate, torch.nn.Module)
    results = []
    print(
        f"hidden {args.hidden_size}, {args.num_experts} experts of "
        f"{args.expert_intermediate_size}, top-{args.top_k}, vs dense "
        f"{args.top_k * args.expert_intermediate_size}; {args.layers} layer(s), "
        f"{args.num_threads} thread(s); ms per step of all layers"
    )
    print(f"{'tokens':>6} {'hit (layer 0)':>13} {'moe':>8} {'dense':>8} {'moe/dense':>9}"
          + (f" {'torch moe':>9}" if reference is not None else ""))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(t, args.hidden_size, generator=g)
        with torch.no_grad():
            hit = len(set(torch.topk(gate(x), args.top_k).indices.reshape(-1).tolist()))
            runs: dict[str, list[float]] = {"moe": [], "dense": [], "torch": []}
            for _ in range(5):
                runs["moe"].append(_median_time(moe, x, args.min_time / 5))
                runs["dense"].append(_median_time(dense, x, args.min_time / 5))
                if reference is not None:
                    runs["torch"].append(_median_time(reference, x, args.min_time / 5))
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in runs.items() if v}
        row = dict(tokens=t, experts_hit=hit, **{f"{k}_ms": v for k, v in med.items()})
        results.append(row)
        line = f"{t:>6} {hit:>13} {med['moe']:>8.3f} {med['dense']:>8.3f} "
        line += f"{med['moe'] / med['dense']:>8.2f}x"
        if "torch" in med:
            line += f" {med['torch']:>9.3f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
