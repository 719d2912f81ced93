"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

The model reads like the math: ``forward(input_ids, positions) -> hidden`` and
``compute_logits(hidden)``. The batch is one flat run of tokens from many requests;
attention finds each request's K/V through the forward context. q/k/v and gate/up are
fused into one matmul each, filled from HF's separate tensors by ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.config import ModelConfig
from fleetserve.forward_context import cpu_kernels_active
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import DecodePlan
from fleetserve.layers.attention import Attention
from fleetserve.layers.linear import Linear, pack_linears
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding
from fleetserve.lora.context import lora_rows
from fleetserve.models.llama_decode import run_decode

if TYPE_CHECKING:
    from fleetserve.lora.fused import FusedLoRA


class LlamaAttention(nn.Module):
    """q/k/v fused, optional per-head q/k norm, RoPE, attention, o_proj. Gemma 3's
    attention is this one with its own score scale, o_proj bias and q/k norm always on
    (models/gemma3.py), hence the keyword overrides."""

    def __init__(
        self,
        cfg: ModelConfig,
        rope: RotaryEmbedding,
        window: int | None = None,
        *,
        scale: float | None = None,
        o_proj_bias: bool = False,
        qk_norm: bool | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_proj_bias)
        self.qk_norm = cfg.qk_norm if qk_norm is None else qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope = rope
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            window,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rope(positions, q, k)
        o = self.attn(q, k, v)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), gate and up fused in one projection."""

    activation = "silu"  # the C decode step's name for it (kernels/decode_step.py)

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_kernels_active():
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaMLP(GatedMLP):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rope, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes and returns the hidden state as (x, residual), their sum the stream
        itself: the add is folded into the next norm. residual None: x is the stream."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_model_len + 1, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Mistral's window (every layer) or Qwen2/3's upper layers' (config.layer_windows).
        windows = cfg.layer_windows or (None,) * cfg.num_hidden_layers
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, rope, w) for w in windows])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The whole step in one C call when its rows are all decodes (llama_decode.py);
        # bound by the model runner once the caches are (None: modules only).
        self.decode_plan: DecodePlan | None = None
        # The LoRA slots the C step applies to adapter rows (lora/fused.py; None: a step
        # with adapter rows takes the module path).
        self.decode_lora: FusedLoRA | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = embed_rows(self.embed_tokens, input_ids)
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


def embed_rows(embed: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`embed(input_ids)`; a plain float32 table on the CPU is read by numpy on this
    thread: torch's lookup is an OpenMP region, whose threads a step's C region has just
    left spinning (a busy machine's descheduled partner makes it cost milliseconds)."""
    w = getattr(embed, "weight", None)
    if type(embed) is not nn.Embedding or w is None or input_ids.device.type != "cpu":
        return embed(input_ids)
    if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
        return embed(input_ids)
    ids = input_ids.numpy()
    if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < w.shape[0]:
        return embed(input_ids)  # torch's own error for an id off the table
    return torch.from_numpy(np.take(w.detach().numpy(), ids, axis=0))


# HF tensor name suffix -> (our fused parameter suffix, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    # Whether models/llama_decode.py's C step computes this model (subclasses say no).
    decode_step_capable = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_tied_head: cpu_kernels.PackedWeight | None = None
        # Tensor parallelism swaps in a gather of the vocab shards (models/sharding.py).
        self.logits_gather: nn.Module = nn.Identity()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.packed_tied_head is not None:
            logits = cpu_kernels.packed_linear(hidden, self.packed_tied_head)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        return self.finish_logits(logits)

    def finish_logits(self, head_out: torch.Tensor) -> torch.Tensor:
        """The logits from the head's output (this rank's vocab shard under TP): what
        `compute_logits` does after the head, also applied to the C step's head output."""
        if not isinstance(self.logits_gather, nn.Identity):  # one module call less a step
            head_out = self.logits_gather(head_out)
        return head_out if head_out.dtype == torch.float32 else head_out.float()

    def head_argmax_exact(self) -> bool:
        """Whether the argmax of the head's output is that of the logits: finish_logits
        changes nothing (no gather of vocab shards, float32 head)."""
        return isinstance(self.logits_gather, nn.Identity)

    def pack_for_cpu(self) -> None:
        """Repack the projections for the CPU GEMM kernel (see layers/linear.py). A tied
        head gets a packed copy: the embedding still looks rows up in its own table."""
        pack_linears(self)
        if self.lm_head is None:  # tied: this stage holds the embedding (sharding.py)
            self.packed_tied_head = cpu_kernels.PackedWeight(self.model.embed_tokens.weight)

    def rebuild_rope(self, device: torch.device) -> None:
        """The rotary tables (buffers, left on the meta device) built for real."""
        cfg = self.config
        with torch.device(device):
            rope = RotaryEmbedding(
                cfg.head_dim, cfg.max_model_len + 1, cfg.rope_theta, cfg.rope_scaling
            )
        for layer in self.decoder_layers():
            layer.self_attn.rope = rope

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [cast(LlamaDecoderLayer, layer) for layer in self.model.layers]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [q, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store the copy anyway
            target, offset, size = name, 0, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                sizes = self._shard_sizes(fused)
                offset, size = sum(sizes[:shard]), sizes[shard]
                filled_key = name
            else:
                filled_key = target
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            dest = param.data if size is None else param.data.narrow(0, offset, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled.add(filled_key)
        expected = set()
        for pname in params:
            parts = pname.split(".")
            fused = parts[-2] if len(parts) >= 2 else ""
            if fused in ("qkv_proj", "gate_up_proj"):
                for hf, (f, _) in _FUSED.items():
                    if f == fused:
                        expected.add(".".join(parts[:-2] + [hf, parts[-1]]))
            else:
                expected.add(pname)
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
