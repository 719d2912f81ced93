"""Quantized weights: which kind a model gets, and the transforms that put them in place.

- ``"gguf"``: the projections, the embedding and the LM head of a GGUF checkpoint stay
  in the file's block formats (kernels/quant.py). `keep_gguf_quantized` runs on the model
  while it is still on the ``meta`` device, so the float32 copies are never allocated.
- ``"int8"``: any checkpoint's projections (and LM head) are quantized at load to int8
  with one float16 scale per 32 inputs of each output channel (GGUF's Q8_0 blocks, so
  the same kernels run them); weight-only, activations stay float32.
- ``"none"``: everything in ``dtype`` (a GGUF checkpoint is dequantized at load).

``None`` (the default) picks ``"gguf"`` for a GGUF checkpoint on one CPU process in
float32 with the C kernels built, else ``"none"`` (the choice: models/quant_choice.py,
which imports no torch, for the API process's config).

``int8_activations`` (with ``"gguf"`` or ``"int8"``): the Q4_0 / Q4_1 / Q8_0 weights are
laid out for integer dot products, and every matmul with them (decode, verification and
prefill rows) quantizes its input rows to int8 per block of 32 (kernels/quant_dot.h; W8A8
for ``"int8"``), in the module path and the C step alike. Other formats (the K-quants)
keep float32 activations. ``None`` (the default) turns it on for ``"gguf"`` where the kernels
were built with AVX-512 VNNI (SmolLM2 Q4_1: the decode step's GEMMs take 1.7x less
CPU, prefill GEMMs 1.5-2.3x; perplexity 21.04 against 21.14; docs/benchmarks.md), and
says so at start-up;
``FLEETSERVE_INT8_ACTIVATIONS=0`` (or ``1``) overrides that default, ``False`` keeps
float32 activations (the reference path).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fleetserve.kernels.quant import (
    BLOCK_SHAPES,
    DOT_QTYPES,
    QType,
    QuantWeight,
    supported,
)
from fleetserve.layers.linear import Linear
from fleetserve.layers.quant_linear import QuantEmbedding, QuantLinear
from fleetserve.models.gguf_loader import GGUFWeights
from fleetserve.models.llama import LlamaForCausalLM
from fleetserve.models.loader import ModelSource
from fleetserve.models.moe import ROUTERS, SparseMoeBlock
from fleetserve.models.quant_choice import (
    INT8_ACTIVATIONS_ENV,
    QUANTIZATIONS,
    resolve_int8_activations,
    resolve_quantization,
)

__all__ = [
    "INT8_ACTIVATIONS_ENV",
    "QUANTIZATIONS",
    "keep_gguf_quantized",
    "quantize_int8",
    "quantize_q8_0",
    "resolve_int8_activations",
    "resolve_quantization",
]


def _quant_weight(
    qtype: QType, blocks: np.ndarray | torch.Tensor, int8_activations: bool
) -> QuantWeight:
    block, nbytes = BLOCK_SHAPES[qtype]
    dot = int8_activations and qtype in DOT_QTYPES
    return QuantWeight(qtype, blocks, blocks.shape[1] // nbytes * block, int8_activations=dot)


def _quant_linear(
    weights: GGUFWeights, names: list[str], bias: bool, int8_activations: bool
) -> QuantLinear | None:
    """A QuantLinear over the GGUF tensors `names` (row segments in order), or None when
    one of them is missing or not in a supported block format. Neighbours of one block
    type become one segment (their rows concatenated): one kernel call, not three."""
    present = set(weights.tensor_names())
    parts: list[tuple[int, np.ndarray]] = []
    for name in names:
        if name not in present or not supported(weights.qtype(name)):
            return None
        parts.append(weights.get_blocks(name))
    segments = []
    i = 0
    while i < len(parts):
        j = i
        while j + 1 < len(parts) and parts[j + 1][0] == parts[i][0]:
            j += 1
        qtype = QType(parts[i][0])
        blocks = parts[i][1] if j == i else np.concatenate([b for _, b in parts[i : j + 1]])
        segments.append(_quant_weight(qtype, blocks, int8_activations))
        i = j + 1
    return QuantLinear(segments, bias=bias)


def keep_gguf_quantized(
    model: LlamaForCausalLM, source: ModelSource, int8_activations: bool = False
) -> set[str]:
    """Swap in quantized layers wherever the GGUF tensors are in a supported block
    format; returns the checkpoint names they consumed (load_weights skips them)."""
    weights = source.weights
    if not isinstance(weights, GGUFWeights):
        raise ValueError("quantization='gguf' needs a .gguf checkpoint")
    cfg = model.config
    consumed: set[str] = set()

    def swap(names: list[str], bias: bool = False) -> QuantLinear | None:
        layer = _quant_linear(weights, names, bias, int8_activations)
        if layer is not None:
            consumed.update(names)
        return layer

    for i, layer in enumerate(model.decoder_layers()):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
        if (q := swap(qkv, bias=cfg.attention_bias)) is not None:
            attn.qkv_proj = q  # type: ignore[assignment]
        if (q := swap([f"{p}self_attn.o_proj.weight"])) is not None:
            attn.o_proj = q  # type: ignore[assignment]
        if (q := swap([f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"])) is not None:
            mlp.gate_up_proj = q  # type: ignore[assignment]
        if (q := swap([f"{p}mlp.down_proj.weight"])) is not None:
            mlp.down_proj = q  # type: ignore[assignment]
    embed = _quant_linear(weights, ["model.embed_tokens.weight"], False, int8_activations)
    if embed is not None:
        consumed.add("model.embed_tokens.weight")
        model.model.embed_tokens = QuantEmbedding(embed.segments[0])  # type: ignore[assignment]
    if model.lm_head is not None:
        if (q := swap(["lm_head.weight"])) is not None:
            model.lm_head = q  # type: ignore[assignment]
    elif embed is not None:
        # Tied: the head reads the embedding's blocks, one quantized copy for both.
        model.lm_head = embed  # type: ignore[assignment]
    return consumed


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float32 [n, k] -> Q8_0 blocks uint8 [n, k / 32 * 34], as gguf.quants.quantize
    makes them: d = max|w| / 127 per block of 32, q = round(w / d)."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    # Round half away from zero, like gguf's np_roundf (torch.round goes to even).
    scaled = blocks * inv
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    return torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(
        n, -1
    )


def quantize_int8(model: nn.Module, int8_activations: bool = False) -> int:
    """Replace every `Linear` (and a tied LM head) of a loaded float32 model by a
    Q8_0 QuantLinear (laid out for int8 activations if asked); returns how many were
    replaced. Layers whose inputs are not a multiple of 32 stay float32."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(parent, SparseMoeBlock) and name in ROUTERS:
                continue  # tiny, and a rounding error there would swap a token's experts
            if isinstance(child, Linear) and child.in_features % 32 == 0:
                q = QuantLinear(
                    [_quant_weight(QType.Q8_0, quantize_q8_0(child.weight), int8_activations)],
                    bias=child.bias is not None,
                )
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.detach().float(), requires_grad=False)
                setattr(parent, name, q)
                count += 1
    if isinstance(model, LlamaForCausalLM) and model.lm_head is None:
        emb = model.model.embed_tokens.weight
        if emb.shape[1] % 32 == 0:
            head = _quant_weight(QType.Q8_0, quantize_q8_0(emb), int8_activations)
            model.lm_head = QuantLinear([head])  # type: ignore[assignment]
            count += 1
    return count
