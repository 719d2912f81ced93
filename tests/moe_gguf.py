"""Write a tiny MoE checkpoint as llama.cpp's converter would: experts stacked per layer."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import torch

from helpers import llama_cpp_permute

_GGUF_ARCH = {
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_EXPERT_GGUF = {
    "w1": "ffn_gate_exps",
    "gate_proj": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "up_proj": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "down_proj": "ffn_down_exps",
}


def write_tiny_moe_gguf(hf_dir: str, out_path: str, qtypes: dict[str, Any] | None = None) -> None:
    """`qtypes`: GGUF tensor kind (e.g. "ffn_gate_exps", "ffn_up_shexp") -> a
    GGMLQuantizationType to store it in; everything else is F32."""
    import gguf

    from fleetserve.models.loader import resolve_model

    qtypes = qtypes or {}
    src = resolve_model(hf_dir)
    cfg = src.hf_config
    arch = _GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg["vocab_size"])
    num_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "llama":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    with open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(sorted(vocab, key=vocab.__getitem__))
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(vocab))])
    writer.add_token_merges([" ".join(pair) for pair in tok["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)

    def add(name: str, w: np.ndarray) -> None:
        kind = name.split(".")[-2]
        qtype = qtypes.get(kind)
        if qtype is not None:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))

    stacked: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in src.tensor_names():
        w = src.get_tensor(name, torch.float32).numpy()
        m = _EXPERT.fullmatch(name)
        if m is not None:
            key = (int(m.group(1)), _EXPERT_GGUF[m.group(3)])
            stacked.setdefault(key, {})[int(m.group(2))] = w
            continue
        module, suffix = name.rsplit(".", 1)
        if module in _TOP:
            add(f"{_TOP[module]}.{suffix}", w)
            continue
        layer, rest = module.split(".")[2], ".".join(module.split(".")[3:])
        gguf_name = f"blk.{layer}.{_BLOCK[rest]}.{suffix}"
        if arch == "llama" and rest == "self_attn.q_proj":
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and rest == "self_attn.k_proj":
            w = llama_cpp_permute(w, kv_heads)
        elif rest == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # llama.cpp's shape: a vector
        add(gguf_name, w)
    for (layer, kind), per_expert in sorted(stacked.items()):
        add(f"blk.{layer}.{kind}.weight", np.stack([per_expert[e] for e in range(num_experts)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
