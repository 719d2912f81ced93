"""Tensor and expert parallelism of the MoE blocks (models/moe.py); sharding.py's MoE part.

Attention is TP-sharded as in any Llama-family model, so every rank enters a MoE block
holding the full hidden state of every token of the step. The router is replicated (each
rank computes the same top-k), and the routed experts are split one of two ways:

- plain TP: every rank holds a slice of every expert (its gate/up rows and down columns,
  like a dense MLP) and runs every routed token through its slices;
- expert parallelism (``expert_parallel``): rank r holds experts [r * E / N, (r + 1) *
  E / N) whole and runs only the tokens routed to them.

Either way each rank's output is a partial sum over the experts (or expert slices) it
holds, and the block's one all-reduce completes it: the same collective, and the same
bytes, as a dense TP MLP. Because attention leaves the tokens already replicated on
every rank, no all-to-all is needed to bring tokens to their experts: the "dispatch" is
free and the "combine" is that all-reduce. (An all-to-all pays off when attention is
data-parallel, each rank holding different tokens; fleetserve's TP attention is not.)
The shared expert of Qwen2-MoE is a dense MLP and is TP-sharded in both modes.
"""

from __future__ import annotations

import torch

from fleetserve.config import ModelConfig, ParallelConfig
from fleetserve.distributed.parallel_state import ParallelContext, stage_layers
from fleetserve.layers.linear import Linear
from fleetserve.models.loader import ModelSource
from fleetserve.models.moe import (
    MoEExperts,
    MoeForCausalLM,
    SharedExpertMLP,
    SparseMoeBlock,
    canonical_name,
    parse_expert_name,
)


def check_moe_parallel(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """ValueError when the MoE blocks cannot be split this way."""
    moe, tp = cfg.moe, parallel.tensor_parallel_size
    if moe is None:
        if parallel.expert_parallel:
            raise ValueError(
                f"expert_parallel needs a mixture-of-experts model, not {cfg.architecture}"
            )
        return
    if parallel.expert_parallel:
        if moe.num_experts % tp:
            raise ValueError(
                f"with expert_parallel, tensor_parallel_size={tp} must divide "
                f"num_experts={moe.num_experts}"
            )
    elif moe.moe_intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the experts' intermediate size "
            f"{moe.moe_intermediate_size} (or use expert_parallel)"
        )
    shared = moe.shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide shared_expert_intermediate_size={shared}"
        )


def shard_moe_block(block: SparseMoeBlock, cfg: ModelConfig, ctx: ParallelContext) -> None:
    """Cut a meta-device MoE block down to this rank's share (see the module docstring)."""
    moe = cfg.moe
    assert moe is not None
    tp, r, hidden = ctx.tp_size, ctx.tp_rank, cfg.hidden_size
    if ctx.expert_parallel:
        per_rank = moe.num_experts // tp
        block.experts = MoEExperts(hidden, moe.moe_intermediate_size, per_rank, r * per_rank)
    else:
        block.experts = MoEExperts(hidden, moe.moe_intermediate_size // tp, moe.num_experts)
    if moe.shared_expert_intermediate_size is not None:
        block.shared_expert = SharedExpertMLP(hidden, moe.shared_expert_intermediate_size // tp)
        block.shared_expert_gate = Linear(hidden, 1, bias=False)
    block.ctx = ctx


def _resolve(names: dict[str, str], name: str) -> str:
    """The checkpoint's own name for our (canonical) tensor name."""
    try:
        return names[name]
    except KeyError:
        raise ValueError(f"checkpoint has no tensor for {name!r}") from None


@torch.no_grad()
def load_moe_shards(model: MoeForCausalLM, source: ModelSource, ctx: ParallelContext) -> set[str]:
    """Fill this rank's MoE-block parameters; returns their names (load_shards skips them)."""
    cfg = model.config
    dtype, r = cfg.dtype, ctx.tp_rank
    names = {canonical_name(n): n for n in source.tensor_names()}
    # (layer, expert or None, our parameter, shard) -> checkpoint name
    experts_in = {e: n for n in source.tensor_names() if (e := parse_expert_name(n)) is not None}
    first_layer = stage_layers(cfg.num_hidden_layers, ctx.pp_size, ctx.pp_rank).start
    filled: set[str] = set()
    for i, dec in enumerate(model.decoder_layers()):
        block = dec.mlp
        if not isinstance(block, SparseMoeBlock):
            continue
        ours, theirs = f"model.layers.{i}.mlp.", f"model.layers.{i + first_layer}.mlp."
        block.gate.weight.copy_(source.get_tensor(_resolve(names, theirs + "gate.weight"), dtype))
        filled.add(ours + "gate.weight")
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            s = block.shared_expert.intermediate_size
            sh = theirs + "shared_expert."
            gu = block.shared_expert.gate_up_proj.weight
            for half, proj in enumerate(("gate_proj", "up_proj")):
                part = source.get_slice(f"{sh}{proj}.weight", 0, r * s, (r + 1) * s, dtype)
                gu.narrow(0, half * s, s).copy_(part)
            down = source.get_slice(f"{sh}down_proj.weight", 1, r * s, (r + 1) * s, dtype)
            block.shared_expert.down_proj.weight.copy_(down)
            gate = source.get_tensor(theirs + "shared_expert_gate.weight", dtype)
            block.shared_expert_gate.weight.copy_(gate)
            for p in (
                "shared_expert.gate_up_proj",
                "shared_expert.down_proj",
                "shared_expert_gate",
            ):
                filled.add(f"{ours}{p}.weight")
        start = 0 if ctx.expert_parallel else r * block.experts.intermediate_size
        _load_experts(block.experts, i + first_layer, experts_in, source, dtype, start)
        filled.update({ours + "experts.gate_up_proj", ours + "experts.down_proj"})
    return filled


# (our parameter, shard within gate_up_proj) of each expert's three projections
_PARTS = (("gate_up_proj", 0), ("gate_up_proj", 1), ("down_proj", None))


def _load_experts(
    experts: MoEExperts,
    layer: int,
    experts_in: dict[tuple[int, int | None, str, int | None], str],
    source: ModelSource,
    dtype: torch.dtype,
    start: int,
) -> None:
    """This rank's experts of checkpoint layer `layer`: rows [start, start + inter) of
    each (all experts under plain TP; its own, whole, under EP), from per-expert tensors
    or from tensors stacked over the experts (GGUF's ffn_*_exps)."""
    inter = experts.intermediate_size  # this rank's rows of each expert
    stacked_cache: dict[str, torch.Tensor] = {}
    for e in range(experts.num_local):
        g = experts.first_expert + e
        for param, shard in _PARTS:
            dest = getattr(experts, param).data[e]
            if shard is not None:
                dest = dest.narrow(0, shard * inter, inter)
            dim = 0 if param == "gate_up_proj" else 1  # down: slice its input columns
            own = experts_in.get((layer, g, param, shard))
            if own is not None:
                part = source.get_slice(own, dim, start, start + inter, dtype)
            else:
                stacked = experts_in.get((layer, None, param, shard))
                if stacked is None:
                    raise ValueError(
                        f"checkpoint has no {param}[{shard}] for expert {g} of layer {layer}"
                    )
                if stacked not in stacked_cache:
                    stacked_cache[stacked] = source.get_tensor(stacked, dtype)
                part = stacked_cache[stacked][g].narrow(dim, start, inter)
            if tuple(part.shape) != tuple(dest.shape):
                raise ValueError(
                    f"expert {g} of layer {layer}: {param}[{shard}] has shape "
                    f"{tuple(part.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(part)
