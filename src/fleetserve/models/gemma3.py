"""Gemma 3 text decoder (``Gemma3ForCausalLM``; the text part of ``Gemma3ForConditionalGeneration``).

Differences from Llama, each one line of the math below:

- RMSNorm scales by ``1 + w``: the ``1 +`` is folded into the weight at load, so the
  norms (and their C kernels) are Llama's;
- a norm before and after both attention and the MLP (four per layer);
- the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
- the embedding is scaled by ``sqrt(hidden_size)``;
- q/k norm per head; scores scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma 3 has an
  `attn_logit_softcapping` field but, like transformers and llama.cpp, does not apply it:
  that was Gemma 2's);
- local ("sliding_attention") layers attend to the last ``sliding_window`` tokens with
  their own RoPE base (``rope_local_base_freq``), global layers to everything;
- an optional final logit softcap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.config import ModelConfig
from fleetserve.forward_context import cpu_kernels_active
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import DecodePlan
from fleetserve.layers.linear import Linear
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding
from fleetserve.lora.context import lora_rows
from fleetserve.models.llama import LlamaAttention, LlamaForCausalLM
from fleetserve.models.llama_decode import run_decode

if TYPE_CHECKING:
    from fleetserve.lora.fused import FusedLoRA


def rope_settings(
    hf: dict[str, Any],
) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((theta, scaling) of the global layers, (theta, scaling) of the local ones), from
    either config style: transformers 5's per-layer-type `rope_parameters` or the older
    `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = hf.get("rope_parameters")
    out = []
    for kind, theta_key, default in (
        ("full_attention", "rope_theta", 1_000_000.0),
        ("sliding_attention", "rope_local_base_freq", 10_000.0),
    ):
        p = params.get(kind) if isinstance(params, dict) else None
        if p is not None:
            theta = float(p.get("rope_theta", hf.get(theta_key) or default))
            scaling = p if p.get("rope_type", "default") != "default" else None
        else:
            theta = float(hf.get(theta_key) or default)
            scaling = hf.get("rope_scaling") if kind == "full_attention" else None
            if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
                None,
                "default",
            ):
                scaling = None
        out.append((theta, scaling))
    return out[0], out[1]


class Gemma3Attention(LlamaAttention):
    """Llama's attention with q/k norm always on, scores scaled by
    ``query_pre_attn_scalar ** -0.5`` and o_proj biased like q/k/v."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, window: int | None) -> None:
        scalar = float(cfg.hf_config.get("query_pre_attn_scalar") or cfg.head_dim)
        super().__init__(
            cfg, rope, window, scale=scalar**-0.5, o_proj_bias=cfg.attention_bias, qk_norm=True
        )


class Gemma3MLP(nn.Module):
    activation = "gelu_tanh"  # the C decode step's name for it (kernels/decode_step.py)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        act = cfg.hf_config.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_kernels_active():  # the row code the C decode step runs
            return self.down_proj(cpu_kernels.gelu_tanh_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, rope, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) as in LlamaDecoderLayer: their sum is the stream."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h))
        h, residual = self.pre_feedforward_layernorm.forward_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        windows = cfg.layer_windows or (None,) * cfg.num_hidden_layers
        self.global_rope, self.local_rope = _ropes(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.layers = nn.ModuleList(
            [
                Gemma3DecoderLayer(cfg, self.local_rope if w else self.global_rope, w)
                for w in windows
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The whole step in one C call (models/llama_decode.py), bound by the runner, and
        # the LoRA slots it applies to adapter rows (lora/fused.py), as LlamaModel's.
        self.decode_plan: DecodePlan | None = None
        self.decode_lora: FusedLoRA | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # transformers multiplies by the scale cast to the weights' dtype.
        x = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32)
        groups = lora_rows()
        if self.decode_plan is not None and (groups is None or self.decode_lora is not None):
            lora = None if groups is None else cast("FusedLoRA", self.decode_lora).step(groups)
            out = run_decode(self.decode_plan, x, positions, lora)
            if out is not None:
                return out
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        if residual is not None:
            x = x + residual
        return self.norm(x)


def _ropes(cfg: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    (g_theta, g_scaling), (l_theta, l_scaling) = rope_settings(cfg.hf_config)
    n = cfg.max_model_len + 1
    return (
        RotaryEmbedding(cfg.head_dim, n, g_theta, g_scaling),
        RotaryEmbedding(cfg.head_dim, n, l_theta, l_scaling),
    )


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3Model(cfg)  # type: ignore[assignment]
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.packed_tied_head = None
        self.logits_gather = nn.Identity()
        cap = cfg.hf_config.get("final_logit_softcapping")
        self.final_softcap = float(cap) if cap else None

    def finish_logits(self, head_out: torch.Tensor) -> torch.Tensor:
        logits = super().finish_logits(head_out)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def head_argmax_exact(self) -> bool:
        # A softcap's tanh can round two logits to the same value: not the same argmax.
        return self.final_softcap is None and super().head_argmax_exact()

    def rebuild_rope(self, device: torch.device) -> None:
        model: Gemma3Model = self.model  # type: ignore[assignment]
        with torch.device(device):
            model.global_rope, model.local_rope = _ropes(self.config)
        for layer in self.decoder_layers():
            window = layer.self_attn.attn.sliding_window
            layer.self_attn.rope = model.local_rope if window else model.global_rope

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF's Gemma norms scale by (1 + w): the 1 is added here, once. A
        Gemma3ForConditionalGeneration checkpoint gives its language model's tensors
        (its vision tower and projector are not used: text only)."""

        def shifted() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = _text_model_name(hf_name)
                if name is None:
                    continue
                if name.endswith("norm.weight"):
                    tensor = tensor.float() + 1.0
                yield name, tensor

        super().load_weights(shifted())


_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def text_model_names(names: Iterable[str]) -> dict[str, str]:
    """The text model's tensor name -> the checkpoint's (they differ in a
    Gemma3ForConditionalGeneration checkpoint); vision tensors left out."""
    return {text: name for name in names if (text := _text_model_name(name)) is not None}


def _text_model_name(name: str) -> str | None:
    """A Gemma3ForConditionalGeneration tensor's name in the text model (None: a vision
    tensor); other names unchanged."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for old, new in (
        ("model.language_model.", "model."),  # transformers >= 4.52
        ("language_model.model.", "model."),  # older checkpoints
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name
