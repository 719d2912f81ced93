"""BERT encoder (HF `BertModel` without its pooler), for embedding models such as MiniLM.

``forward(input_ids, attention_mask) -> last_hidden_state``: a padded batch in, one hidden
vector per token out. Post-LayerNorm layers, as the original BERT: each sub-block adds its
input back and then normalises.

Padding costs no compute where the compute is: the real tokens are packed into one
[num_tokens, hidden] matrix for every linear layer, LayerNorm and GELU, and only attention
sees the padded [batch, heads, seq, head_dim] layout (its keys masked). A batch of short and
long inputs therefore costs the sum of their lengths, not batch x longest. Module names follow HF's checkpoints (including the
submodule literally called ``self`` inside ``attention``) so weights load by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

# HF's names for the activation; "gelu" is the exact (erf) form, "gelu_new" the tanh fit.
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> BertConfig:
        if cfg.get("model_type") != "bert":
            raise ValueError(f"model_type must be 'bert', got {cfg.get('model_type')!r}")
        pos = cfg.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(f"position_embedding_type must be 'absolute', got {pos!r}")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got {act!r}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            pad_token_id=int(cfg.get("pad_token_id", 0)),
        )


@dataclass(frozen=True)
class PackedLayout:
    """Where the packed tokens sit in the padded [batch, seq] grid."""

    index: torch.Tensor  # [num_tokens] flat positions in batch * seq
    batch: int
    seq: int
    key_mask: torch.Tensor  # [batch, 1, 1, seq], True where the key is a real token

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> PackedLayout:
        b, s = attention_mask.shape
        mask = attention_mask.bool()
        index = mask.reshape(-1).nonzero().squeeze(1)
        return cls(index, b, s, mask[:, None, None, :])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, d] -> [batch, seq, d], zeros at the padding."""
        out = x.new_zeros(self.batch * self.seq, x.shape[-1])
        out[self.index] = x
        return out.view(self.batch, self.seq, -1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, d] -> [num_tokens, d]."""
        return x.reshape(self.batch * self.seq, -1)[self.index]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens]. One segment per input: every token type is 0.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        # x: [num_tokens, hidden] -> same
        b, s = layout.batch, layout.seq

        def heads(t: torch.Tensor) -> torch.Tensor:  # [num_tokens, h*d] -> [b, h, s, d]
            return layout.pad(t).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        # Padded query rows still attend to the real keys, so no row is all-masked (no NaN);
        # they are dropped by `pack` right after.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask)
        return layout.pack(out.transpose(1, 2))


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(attn) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        # HF calls the projection block `self`; the checkpoint's names depend on it.
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        return self.output(self.self(x, layout), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.approximate = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertOutput(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        h = self.attention(x, layout)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, layout)
        return x


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [batch, seq] (mask 1 = token, 0 = padding).
        Returns the last hidden state, [batch, seq, hidden]."""
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"input of {input_ids.shape[1]} tokens exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        layout = PackedLayout.from_mask(attention_mask)
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).expand(b, s).reshape(-1)
        x = self.embeddings(input_ids.reshape(-1)[layout.index], positions[layout.index])
        return layout.pad(self.encoder(x, layout))  # [b, s, hidden], zeros at padding

    @classmethod
    def from_folder(cls, folder: str) -> BertModel:
        """Build from a HF folder holding config.json and model.safetensors (float32)."""
        with open(os.path.join(folder, "config.json")) as f:
            cfg = BertConfig.from_hf(json.load(f))
        weights_path = os.path.join(folder, "model.safetensors")
        if not os.path.isfile(weights_path):
            raise FileNotFoundError(f"no model.safetensors in {folder}")
        state = load_file(weights_path)
        # Some checkpoints prefix every name with the architecture ("bert.").
        state = {k.removeprefix("bert."): v for k, v in state.items()}
        model = cls(cfg)
        expected = set(model.state_dict())
        missing = sorted(expected - set(state))
        if missing:
            raise ValueError(f"{weights_path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
        # The pooler and the stored position_ids buffer are not used by an embedding model.
        model.load_state_dict({k: state[k].float() for k in expected}, strict=True)
        return model.eval()
