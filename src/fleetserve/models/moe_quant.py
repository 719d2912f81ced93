"""GGUF experts kept in their block formats (quantization="gguf" for MoE models).

llama.cpp stores a layer's routed experts as three tensors stacked over the experts
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [num_experts, rows, cols], or a fused
`ffn_gate_up_exps`), one row of blocks per output feature. Expert e's rows are one
contiguous run of them, so each expert becomes its own `QuantWeight`s (kernels/quant.py)
and the grouped kernel (kernels/moe.c) multiplies them with quant_gemm.c. The router and
the shared expert's gate stay float32 (llama.cpp writes them so); the shared expert goes
through `quantize.py`'s QuantLinear like any dense MLP.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fleetserve.kernels.moe import ExpertWeights, Weight
from fleetserve.kernels.quant import QType, QuantWeight, supported
from fleetserve.models.gguf_loader import GGUFWeights
from fleetserve.models.loader import ModelSource
from fleetserve.models.moe import MoeForCausalLM, SparseMoeBlock
from fleetserve.models.quantize import _quant_linear, _quant_weight


def _stacked(weights: GGUFWeights, name: str, num_experts: int) -> tuple[QType, np.ndarray] | None:
    """(block type, bytes [num_experts, rows, row_bytes]) of a stacked expert tensor, or
    None when absent or in a format the kernels do not take."""
    if name not in set(weights.tensor_names()) or not supported(weights.qtype(name)):
        return None
    qtype, raw = weights.get_blocks(name)  # [num_experts * rows, row_bytes]
    return QType(qtype), raw.reshape(num_experts, -1, raw.shape[1])


def keep_gguf_experts_quantized(
    model: MoeForCausalLM, source: ModelSource, int8_activations: bool = False
) -> set[str]:
    """Give every MoE block whose expert tensors are in supported block formats its
    quantized experts (on the meta-device model, before allocation); returns the
    checkpoint names consumed."""
    weights = source.weights
    if not isinstance(weights, GGUFWeights):
        raise ValueError("quantization='gguf' needs a .gguf checkpoint")
    consumed: set[str] = set()
    num_experts = model.moe.num_experts

    def q(qtype: QType, blocks: np.ndarray) -> QuantWeight:
        return _quant_weight(qtype, np.ascontiguousarray(blocks), int8_activations)

    for i, dec in enumerate(model.decoder_layers()):
        block = dec.mlp
        if not isinstance(block, SparseMoeBlock):
            continue
        p = f"model.layers.{i}.mlp."
        if block.shared_expert is not None:
            shared = block.shared_expert
            names = [f"{p}shared_expert.{n}_proj.weight" for n in ("gate", "up")]
            if (layer := _quant_linear(weights, names, False, int8_activations)) is not None:
                shared.gate_up_proj = layer  # type: ignore[assignment]
                consumed.update(names)
            down = [f"{p}shared_expert.down_proj.weight"]
            if (layer := _quant_linear(weights, down, False, int8_activations)) is not None:
                shared.down_proj = layer  # type: ignore[assignment]
                consumed.update(down)
        fused = _stacked(weights, f"{p}experts.gate_up_proj.weight", num_experts)
        gate = _stacked(weights, f"{p}experts.gate_proj.weight", num_experts)
        up = _stacked(weights, f"{p}experts.up_proj.weight", num_experts)
        down_t = _stacked(weights, f"{p}experts.down_proj.weight", num_experts)
        gate_up: list[list[Weight]] = []
        if down_t is None:
            continue  # left to the float32 path: dequantized at load
        if fused is not None:
            gate_up = [[q(fused[0], fused[1][e])] for e in range(num_experts)]
        elif gate is not None and up is not None:
            for e in range(num_experts):
                if gate[0] == up[0]:  # one segment: one GEMM for both
                    gate_up.append([q(gate[0], np.concatenate([gate[1][e], up[1][e]]))])
                else:
                    gate_up.append([q(gate[0], gate[1][e]), q(up[0], up[1][e])])
        else:
            continue
        experts = block.experts
        experts.kernel_weights = ExpertWeights(
            gate_up=gate_up,
            down=[q(down_t[0], down_t[1][e]) for e in range(num_experts)],
            hidden_size=experts.hidden_size,
            intermediate_size=experts.intermediate_size,
        )
        # Nothing of the float32 layout is allocated or loaded.
        experts.gate_up_proj = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
        experts.down_proj = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
        stacked = ("gate_up_proj",) if fused is not None else ("gate_proj", "up_proj")
        consumed.update(f"{p}experts.{n}.weight" for n in (*stacked, "down_proj"))
    return consumed
