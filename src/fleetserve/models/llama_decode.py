"""The fast path of the Llama family: a whole step in one C call.

`bind_decode_plan` builds a `DecodePlan` (kernels/decode_step.py) from a loaded model
whose caches are bound, when every piece of it is something the C step runs: projections
kept in GGUF blocks (`QuantLinear`) or packed for the float32 GEMM (`Linear.packed`), a
qkv bias (Qwen2) or q/k norm (Qwen3), sliding-window layers (Mistral; Qwen2/3's upper
layers, from their own block pool), Gemma 3's layers (its output norms, GeGLU and the
local layers' own rotary tables: `_gemma_parts`), the CPU kernels' cache layout. The LM
head goes into the plan too when it is in one of those layouts (`_head`): the step then
also computes the logits of the rows the runner samples. Under tensor parallelism each
rank's plan holds its shards and sums the row-parallel projections' outputs across the
ranks from inside the step (a callback into `ParallelContext.all_reduce`); a pipeline
stage's plan holds its layers, and one before the last stops at the residual stream (no
final norm, no head). Otherwise the model keeps only its module path.

`run_decode` is what `LlamaModel.forward` asks first: for any step the scheduler builds
(decodes, prefill chunks with or without cached context, draft verification rows, any
number of rows) it returns the final hidden states, and leaves the head's output for the
forward context's `logit_rows` in its `head_logits`; None only without the paged
metadata of the CPU kernels, and the modules run as before. Both paths compute the same
values with the same C code, the GEMMs switching kernels at the same row counts
(tests/test_fused_decode.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from fleetserve.forward_context import get_forward_context
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import (
    DecodePlan,
    LayerWeights,
    PlanShape,
    Weights,
    WindowSlots,
)
from fleetserve.layers.linear import Linear
from fleetserve.layers.parallel import RowParallelLinear
from fleetserve.layers.quant_linear import QuantLinear

if TYPE_CHECKING:
    from fleetserve.models.llama import LlamaForCausalLM


def _weights(layer: torch.nn.Module) -> tuple[Weights, torch.Tensor | None] | None:
    """A projection's weights as the C step takes them, and its bias; None: not runnable."""
    if isinstance(layer, QuantLinear):
        bias = None if layer.bias is None else layer.bias.detach()
        return list(layer.segments), bias
    if isinstance(layer, Linear) and layer.packed is not None:
        bias = None if layer.bias is None else layer.bias.detach()
        return layer.packed, bias
    if isinstance(layer, Linear) and layer.bf16 is not None:
        bias = None if layer.bias is None else layer.bias.detach()
        return layer.bf16, bias
    return None


def _gemma_parts(dec: Any, plan_rope: object) -> dict[str, torch.Tensor]:
    """Gemma 3's extra pieces of a decoder layer (models/gemma3.py), named as
    LayerWeights' fields: its pre-MLP norm in `post_norm`, the norms of the attention's
    and the MLP's outputs, and its rotary tables when they are not the plan's (the local
    layers' base). Empty for the Llama family."""
    if not hasattr(dec, "pre_feedforward_layernorm"):
        return {}
    parts = {
        "post_norm": dec.pre_feedforward_layernorm.weight.detach(),
        "attn_out_norm": dec.post_attention_layernorm.weight.detach(),
        "mlp_out_norm": dec.post_feedforward_layernorm.weight.detach(),
    }
    rope = dec.self_attn.rope
    if rope is not plan_rope:
        parts.update(cos=rope.cos, sin=rope.sin)
    return parts


def _head(model: LlamaForCausalLM) -> Weights | None:
    """The LM head's weight as the C step takes it (this rank's vocab shard under tensor
    parallelism), or None: no head here (a pipeline stage before the last) or one the
    step cannot run, left to `compute_logits`."""
    if isinstance(model.model.norm, torch.nn.Identity):
        return None
    if os.environ.get("FLEETSERVE_C_HEAD", "1") == "0":  # A/B runs: the head after the step
        return None
    if model.lm_head is not None:
        got = _weights(model.lm_head)
        return None if got is None or got[1] is not None else got[0]
    return model.packed_tied_head


def _reduce(
    model: LlamaForCausalLM,
) -> tuple[bool, Callable[[torch.Tensor], torch.Tensor] | None]:
    """(whether the C step can run this rank's layers, the all-reduce it calls after
    the row-parallel projections: None in one process)."""
    rows = [
        isinstance(p, RowParallelLinear)
        for dec in model.decoder_layers()
        for p in (dec.self_attn.o_proj, dec.mlp.down_proj)
    ]
    if not any(rows):
        return True, None
    if not all(rows):
        return False, None
    ctx = cast(RowParallelLinear, model.decoder_layers()[0].self_attn.o_proj).ctx
    return True, (ctx.all_reduce if ctx.tp_size > 1 else None)


def build_decode_plan(model: LlamaForCausalLM) -> DecodePlan | None:
    """The plan for `model`, or None when some part of it is outside the C step."""
    cfg = model.config
    if (
        cfg.dtype != torch.float32
        or cfg.moe is not None  # MoE blocks run on the module path (kernels/moe.py)
        or cfg.head_dim % 2
    ):
        return None
    runnable, reduce = _reduce(model)
    if not runnable:
        return None
    layers: list[LayerWeights] = []
    block_size = 0
    plan_rope = model.decoder_layers()[0].self_attn.rope if model.decoder_layers() else None
    for dec in model.decoder_layers():
        attn, mlp = dec.self_attn, dec.mlp
        parts = [_weights(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in parts):
            return None
        (qkv, qkv_bias), (o, o_bias), (gu, gu_bias), (down, down_bias) = parts  # type: ignore[misc]
        if o_bias is not None or gu_bias is not None or down_bias is not None:
            return None
        k_cache, v_cache = attn.attn.k_cache, attn.attn.v_cache
        if k_cache is None or v_cache is None or k_cache.dim() != 4:
            return None
        num_blocks, kv_heads, block_size, head_dim = v_cache.shape
        want = cpu_kernels.kv_cache_shapes(num_blocks, kv_heads, block_size, head_dim)
        got = (tuple(k_cache.shape), tuple(v_cache.shape))
        if got != want or kv_heads != attn.num_kv_heads:
            return None
        pieces: dict[str, Any] = dict(
            input_norm=dec.input_layernorm.weight.detach(),
            post_norm=dec.post_attention_layernorm.weight.detach(),
            q_norm=attn.q_norm.weight.detach() if attn.qk_norm else None,
            k_norm=attn.k_norm.weight.detach() if attn.qk_norm else None,
            qkv=qkv,
            qkv_bias=qkv_bias,
            o=o,
            gate_up=gu,
            down=down,
            k_cache=k_cache,
            v_cache=v_cache,
            window=attn.attn.sliding_window,
        )
        pieces.update(_gemma_parts(dec, plan_rope))
        layers.append(LayerWeights(**pieces))
    if not layers:
        return None
    first = model.decoder_layers()[0].self_attn
    first_mlp = model.decoder_layers()[0].mlp
    shape = PlanShape(  # this rank's heads and MLP width under tensor parallelism
        hidden=cfg.hidden_size,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate=first_mlp.intermediate_size,
        block_size=block_size,
        eps=cfg.rms_norm_eps,
        scale=first.attn.scale,
        activation=getattr(first_mlp, "activation", "silu"),
    )
    rope = first.rope
    norm = model.model.norm
    final_norm = None if isinstance(norm, torch.nn.Identity) else norm.weight.detach()
    return DecodePlan(shape, layers, rope.cos, rope.sin, final_norm, _head(model), reduce)


def run_decode(
    plan: DecodePlan, x: torch.Tensor, positions: torch.Tensor, lora: int | None = None
) -> torch.Tensor | None:
    """The step's final hidden states through the C step, or None when it does not apply
    (no paged metadata: the plain-torch backend). lora: the step's adapter rows
    (lora/fused.py), or None."""
    meta = get_forward_context()
    paged = meta.paged
    if paged is None or not meta.cpu_kernels or x.shape[0] == 0:
        return None
    window = None
    if meta.sliding is not None:  # the sliding-window layers' own pool
        w = meta.sliding
        assert w.paged is not None, "built beside `paged`, from the same lengths"
        window = WindowSlots(w.slot_blocks, w.slot_offsets, w.paged.block_tables)
    rows = logits = argmax = None
    wanted = meta.logit_rows
    # No row sampled and no hidden state read (a chunk in the middle of its prompts): the
    # head's rows are the empty list, so the last layer stops after its keys and values.
    only = meta.sampled_rows_only and wanted is not None
    if plan.vocab and (wanted or only):
        assert wanted is not None
        if wanted and (
            not 0 <= min(wanted) <= max(wanted) < x.shape[0] or len(set(wanted)) < len(wanted)
        ):
            raise ValueError(f"logit_rows must be distinct rows of the step, got {wanted}")
        # The head's rows in the step.
        rows = torch.tensor(wanted, dtype=torch.int64)
        logits = torch.empty(len(wanted), plan.vocab)
        if meta.want_head_argmax:
            argmax = torch.empty(len(wanted), dtype=torch.int64)
    out = plan.run(
        x, positions, meta.slot_blocks, meta.slot_offsets, paged.q_starts, paged.q_lens,
        paged.seq_lens, paged.block_tables, window, lora, rows, logits, argmax, only,
    )  # fmt: skip
    meta.head_logits = logits
    meta.head_argmax = argmax
    return out
