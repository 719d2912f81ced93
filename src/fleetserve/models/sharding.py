"""Tensor and pipeline parallelism as a transform of a model built on the `meta` device.

`shard_model` keeps this stage's layers and swaps each projection for this TP rank's
slice; `load_shards` then reads only those slices from the checkpoint. The model's
forward code is untouched: a stage without the embedding gets an identity in its place
(its input is the previous stage's hidden state) and a stage without the final norm an
identity too (its output goes to the next stage).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from fleetserve.config import ModelConfig, ParallelConfig
from fleetserve.distributed.parallel_state import (
    ParallelContext,
    kv_head_range,
    stage_layers,
    vocab_range,
)
from fleetserve.layers.attention import Attention
from fleetserve.layers.linear import Linear
from fleetserve.layers.parallel import LogitsGather, RowParallelLinear, VocabParallelEmbedding
from fleetserve.models.gemma3 import (
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3Model,
    text_model_names,
)
from fleetserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from fleetserve.models.loader import ModelSource
from fleetserve.models.moe import MoeForCausalLM, SparseMoeBlock
from fleetserve.models.moe_sharding import check_moe_parallel, load_moe_shards, shard_moe_block


def check_parallel_config(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ValueError when the model cannot be split this way."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if cfg.architecture == "Gemma3ForCausalLM" and cfg.attention_bias and tp > 1:
        raise ValueError(
            "Gemma3ForCausalLM with attention_bias (an o_proj bias) is not supported under "
            "tensor parallelism (use tensor_parallel_size=1)"
        )
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={heads}")
    if kv % tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_key_value_heads={kv} or be a "
            "multiple of it (KV heads are then replicated)"
        )
    check_moe_parallel(cfg, parallel)
    dense = cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_hidden_layers
    if dense and cfg.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide intermediate_size={cfg.intermediate_size}"
        )
    if pp > cfg.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} must be at most num_hidden_layers={cfg.num_hidden_layers}"
        )


def shard_model(model: LlamaForCausalLM, ctx: ParallelContext) -> None:
    """Cut a meta-device LlamaForCausalLM down to this rank's share, in place.

    Call under `torch.device("meta")` so that the new modules allocate nothing.
    """
    cfg = model.config
    tp, hd, hidden = ctx.tp_size, cfg.head_dim, cfg.hidden_size
    inner = model.model
    layers = stage_layers(cfg.num_hidden_layers, ctx.pp_size, ctx.pp_rank)
    inner.layers = nn.ModuleList([inner.layers[i] for i in layers])
    num_heads = cfg.num_attention_heads // tp
    num_kv_heads = len(kv_head_range(cfg.num_key_value_heads, tp, ctx.tp_rank))
    inter = cfg.intermediate_size // tp
    for layer in inner.layers:
        assert isinstance(layer, LlamaDecoderLayer | Gemma3DecoderLayer)
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = num_heads, num_kv_heads
        attn.q_size, attn.kv_size = num_heads * hd, num_kv_heads * hd
        attn.qkv_proj = Linear(hidden, attn.q_size + 2 * attn.kv_size, bias=cfg.attention_bias)
        attn.o_proj = RowParallelLinear(attn.q_size, hidden, ctx)
        attn.attn = Attention(
            num_heads, num_kv_heads, hd, attn.attn.scale, attn.attn.sliding_window
        )
        if isinstance(layer.mlp, SparseMoeBlock):
            shard_moe_block(layer.mlp, cfg, ctx)
            continue
        mlp = layer.mlp
        mlp.intermediate_size = inter
        mlp.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
        mlp.down_proj = RowParallelLinear(inter, hidden, ctx)

    if ctx.is_first_stage:
        inner.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden, ctx)  # type: ignore[assignment]
    else:
        inner.embed_tokens = nn.Identity()  # type: ignore[assignment]
        if isinstance(inner, Gemma3Model):  # its input is a stream, scaled already
            inner.embed_scale = 1.0
    if not ctx.is_last_stage:
        inner.norm = nn.Identity()  # type: ignore[assignment]
        model.lm_head = None
    elif model.lm_head is not None or not ctx.is_first_stage:
        # A tied head on a stage without the embedding gets its own copy of those rows.
        rows = vocab_range(cfg.vocab_size, tp, ctx.tp_rank)[2]
        model.lm_head = Linear(hidden, rows, bias=False)
    if ctx.is_last_stage:
        model.logits_gather = LogitsGather(cfg.vocab_size, ctx)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# (tensor name, dim, start, end, row offset in the destination)
_Piece = tuple[str, int, int, int, int]


def _pieces(name: str, model: LlamaForCausalLM, ctx: ParallelContext) -> list[_Piece] | None:
    """Where parameter `name` of the sharded model comes from; None: the whole tensor."""
    cfg = model.config
    tp, r, hd = ctx.tp_size, ctx.tp_rank, cfg.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, end, _ = vocab_range(cfg.vocab_size, tp, r)
        src = "model.embed_tokens.weight" if cfg.tie_word_embeddings else name
        return [(src, 0, start, end, 0)]
    m = _LAYER.match(name)
    if m is None:
        return None
    start_layer = stage_layers(cfg.num_hidden_layers, ctx.pp_size, ctx.pp_rank).start
    prefix = f"model.layers.{int(m.group(1)) + start_layer}."
    rest = m.group(2)
    leaf = rest.rsplit(".", 1)[-1]  # weight | bias
    if rest.startswith("self_attn.qkv_proj."):
        q = cfg.num_attention_heads // tp * hd
        kv = kv_head_range(cfg.num_key_value_heads, tp, r)
        ks, ke = kv.start * hd, kv.stop * hd
        return [
            (f"{prefix}self_attn.q_proj.{leaf}", 0, r * q, (r + 1) * q, 0),
            (f"{prefix}self_attn.k_proj.{leaf}", 0, ks, ke, q),
            (f"{prefix}self_attn.v_proj.{leaf}", 0, ks, ke, q + ke - ks),
        ]
    if rest == "self_attn.o_proj.weight":
        q = cfg.num_attention_heads // tp * hd
        return [(f"{prefix}{rest}", 1, r * q, (r + 1) * q, 0)]
    inter = cfg.intermediate_size // tp
    if rest == "mlp.gate_up_proj.weight":
        return [
            (f"{prefix}mlp.gate_proj.weight", 0, r * inter, (r + 1) * inter, 0),
            (f"{prefix}mlp.up_proj.weight", 0, r * inter, (r + 1) * inter, inter),
        ]
    if rest == "mlp.down_proj.weight":
        return [(f"{prefix}{rest}", 1, r * inter, (r + 1) * inter, 0)]
    return [(f"{prefix}{rest}", -1, 0, 0, 0)]


@torch.no_grad()
def load_shards(model: LlamaForCausalLM, source: ModelSource, ctx: ParallelContext) -> None:
    """Fill every parameter of a sharded model, reading only its slice of each tensor."""
    dtype = model.config.dtype
    moe_done = load_moe_shards(model, source, ctx) if isinstance(model, MoeForCausalLM) else set()
    # Gemma 3: a ConditionalGeneration checkpoint's names for the text model's tensors,
    # and the norms' (1 + w) added as its load_weights adds it (in float32, then cast).
    gemma = isinstance(model, Gemma3ForCausalLM)
    names = text_model_names(source.tensor_names()) if gemma else {}
    for name, param in model.named_parameters():
        if name in moe_done:
            continue
        pieces = _pieces(name, model, ctx) or [(name, -1, 0, 0, 0)]
        param.data.zero_()  # vocab padding rows stay zero
        for src, dim, start, end, offset in pieces:
            src = names.get(src, src)
            if gemma and name.endswith("norm.weight"):
                part = source.get_tensor(src, torch.float32) + 1.0
            elif dim < 0:
                part = source.get_tensor(src, dtype)
            else:
                part = source.get_slice(src, dim, start, end, dtype)
            if offset + part.shape[0] > param.shape[0] or part.shape[1:] != param.shape[1:]:
                raise ValueError(
                    f"checkpoint tensor {src!r} slice has shape {tuple(part.shape)}, which "
                    f"does not fit {name!r} of shape {tuple(param.shape)} at row {offset}"
                )
            param.data.narrow(0, offset, part.shape[0]).copy_(part)
