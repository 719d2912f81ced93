"""GGUF checkpoints (llama.cpp's format): tensors dequantized to HF names and layout, a HF-style
config synthesized from the metadata, and a HF tokenizer folder materialized once into a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetserve.models.gguf_file import GGUFTensorInfo, read_gguf
from fleetserve.models.loader import ModelSource, check_slice

if TYPE_CHECKING:  # torch: only where tensors are read (the API process resolves without it)
    import torch

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF architecture, HF model_type)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

# llama.cpp's converter interleaves the two rotary halves of each q/k head only for these
# architectures (they use the "normal" rope in llama.cpp); qwen2/qwen3 use NEOX rope, unpermuted.
_PERMUTED_ARCHITECTURES = {"llama"}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Mixture of experts: the router, experts stacked [num_experts, rows, cols] (named as
    # models/moe.py reads them), and Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 3 (llama.cpp's gemma3 arch) names its four norms differently: its ffn_norm is
# the norm *before* the MLP.
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Architectures whose norms scale by (1 + w) in HF: llama.cpp's converter stores 1 + w.
_NORM_SHIFTED_ARCHITECTURES = {"gemma3"}
# Tensors HF models have no place for; llama3-style rope scaling baked into `rope_freqs` is
# not reconstructed (transformers' GGUF loader drops it as well).
_IGNORED_NAMES = {"rope_freqs"}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unmapped."""
    block_names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{suffix}"
    return None


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Per head, HF keeps the rotary pairs as halves: rows [x0..x(d/2-1), y0..y(d/2-1)];
    llama.cpp stores them interleaved: [x0, y0, x1, y1, ...]. Rows are head-major.
    """
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    # [num_heads, head_dim/2, 2, ...] -> [num_heads, 2, head_dim/2, ...]
    w = w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
    return w.reshape(num_heads * head_dim, *rest).contiguous()


class GGUFWeights:
    """Dequantizes GGUF tensors on request; the file itself is memory-mapped by gguf."""

    def __init__(
        self, tensors: list[GGUFTensorInfo], arch: str, num_heads: int, num_kv_heads: int
    ) -> None:
        self._tensors: dict[str, GGUFTensorInfo] = {}  # HF name -> GGUF tensor
        for tensor in tensors:
            hf_name = hf_tensor_name(tensor.name, arch)
            if hf_name is None:
                if tensor.name.rpartition(".")[0] not in _IGNORED_NAMES:
                    logger.warning("ignoring GGUF tensor %s: no HF counterpart", tensor.name)
                continue
            self._tensors[hf_name] = tensor
        self._permuted = arch in _PERMUTED_ARCHITECTURES
        self._norm_shifted = arch in _NORM_SHIFTED_ARCHITECTURES
        self._num_heads = num_heads
        self._num_kv_heads = num_kv_heads

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str) -> GGUFTensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"GGUF checkpoint has no tensor mapping to {name!r}") from None

    def _heads_to_unpermute(self, name: str) -> int | None:
        if not self._permuted:
            return None
        if ".self_attn.q_proj." in name:
            return self._num_heads
        if ".self_attn.k_proj." in name:
            return self._num_kv_heads
        return None

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._tensor(name)
        out = _dequantize(tensor, tensor.data)
        if out.dim() == 1 and name.endswith("shared_expert_gate.weight"):
            out = out.view(1, -1)  # llama.cpp stores the [1, hidden] gate as a vector
        if self._norm_shifted and name.endswith("norm.weight"):
            out = out - 1.0  # back to HF's w (the model adds the 1 again)
        heads = self._heads_to_unpermute(name)
        return out if heads is None else unpermute_rotary(out, heads)

    def get_blocks(self, name: str) -> tuple[int, np.ndarray]:
        """(GGML type id, raw bytes [rows, bytes_per_row]) of a 2-D tensor as stored, rows
        in HF order: a row of blocks is one output feature, so undoing llama.cpp's q/k
        permutation moves whole rows. May be a read-only view of the memory map."""
        tensor = self._tensor(name)
        if tensor.data.ndim != 2:
            raise ValueError(f"{name!r} is not a matrix")
        raw = np.asarray(tensor.data)
        heads = self._heads_to_unpermute(name)
        if heads is None:
            return tensor.qtype, raw
        rows, row_bytes = raw.shape
        # Same move as unpermute_rotary, on rows of bytes.
        per_head = raw.reshape(heads, rows // heads // 2, 2, row_bytes).transpose(0, 2, 1, 3)
        return tensor.qtype, np.ascontiguousarray(per_head).reshape(rows, row_bytes)

    def qtype(self, name: str) -> int:
        return self._tensor(name).qtype

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor:
        tensor = self._tensor(name)
        shape = list(tensor.shape)
        check_slice(name, shape, dim, start, end)
        if dim == 0 and len(shape) == 2 and self._heads_to_unpermute(name) is None:
            # Quantized blocks run along a row, so whole rows can be dequantized alone.
            part = _dequantize(tensor, tensor.data[start:end], rows=end - start)
            return part
        return self.get_tensor(name).narrow(dim, start, end - start)


def _dequantize(tensor: GGUFTensorInfo, data: np.ndarray, rows: int | None = None) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = list(tensor.shape)
    if rows is not None:
        shape[0] = rows
    values = dequantize(data, GGMLQuantizationType(tensor.qtype)).reshape(shape)
    if values.dtype != np.float32 or not values.flags.writeable:
        # F32/F16 tensors come back as read-only views of the memory map.
        values = np.array(values, dtype=np.float32)
    import torch

    return torch.from_numpy(values)


def gguf_hf_config(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int) -> dict:
    """A config.json-style dict for the GGUF metadata `meta` (field name -> value)."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    hf_arch, model_type = _ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    num_experts = int(get("expert_count", 0))
    if arch == "llama" and num_experts:
        hf_arch, model_type = "MixtralForCausalLM", "mixtral"  # llama.cpp's Mixtral
    gating = get("expert_gating_func")
    if num_experts and gating not in (None, 1):  # 1: softmax (ggml's LLAMA_EXPERT_GATING_FUNC)
        raise ValueError(
            f"GGUF {arch} experts gated by function {gating} are not supported (softmax only)"
        )
    layers = int(get("block_count"))
    rope_scaling = None
    if get("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        head_dim = int(get("attention.key_length", hidden // heads))
        # As llama.cpp: local layers use base 10000 and every 6th layer is global; the
        # 27B (62 layers) scales queries by hidden / heads, the others by head_dim.
        extra = {
            "sliding_window": int(get("attention.sliding_window")),
            "sliding_window_pattern": int(get("attention.sliding_window_pattern", 6)),
            "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
            "rope_local_base_freq": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": get("final_logit_softcapping"),
        }
    elif get("attention.sliding_window") is not None:
        raise ValueError(
            f"GGUF architecture {arch!r} with {arch}.attention.sliding_window is not supported"
        )
    return extra | {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or get("expert_feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size", vocab_rows)),
        "tie_word_embeddings": "lm_head.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",  # dequantized
        "hidden_act": "silu",
        **_moe_fields(arch, get, num_experts),
    }


def _moe_fields(arch: str, get: Any, num_experts: int) -> dict[str, Any]:
    """config.json's MoE fields from llama.cpp's expert metadata (none for dense models)."""
    if not num_experts:
        return {}
    fields = {"num_experts_per_tok": int(get("expert_used_count"))}
    if arch == "llama":  # Mixtral: every expert as wide as feed_forward_length
        return {**fields, "num_local_experts": num_experts}
    # llama.cpp's defaults when the file does not say: Qwen3-MoE renormalises the top-k
    # weights, Qwen2-MoE does not.
    norm = get("expert_weights_norm")
    return {
        **fields,
        "num_experts": num_experts,
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": bool(arch == "qwen3moe" if norm is None else norm),
    }


def _cache_root() -> str:
    return os.environ.get("FLEETSERVE_CACHE") or os.path.expanduser("~/.cache/fleetserve")


def gguf_tokenizer_dir(gguf_path: str, chat_template: str | None) -> str:
    """A HF tokenizer folder for `gguf_path`, converted once and cached by path+size+mtime."""
    stat = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}"
    root = os.path.join(_cache_root(), "gguf-tokenizers")
    target = os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:24])
    if os.path.isfile(os.path.join(target, "tokenizer.json")):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        _convert_tokenizer(gguf_path, chat_template, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its folder is equally good.
            if not os.path.isfile(os.path.join(target, "tokenizer.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_tokenizer(gguf_path: str, chat_template: str | None, out_dir: str) -> None:
    from transformers import AutoTokenizer

    logger.info("converting the GGUF tokenizer of %s once (cached afterwards)", gguf_path)
    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    tok.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    # Keep the template in tokenizer_config.json too, for readers that predate chat_template.jinja.
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    special = {
        k: config[k]
        for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        if config.get(k) is not None
    }
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2, ensure_ascii=False)


def check_tensor_types(path: str, tensors: list[GGUFTensorInfo]) -> None:
    """ValueError naming the first tensor stored in a GGML type that cannot be read
    (neither a kernel's block format nor one gguf-py dequantizes)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import _type_traits

    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    for t in tensors:
        try:
            qtype = GGMLQuantizationType(t.qtype)
        except ValueError:
            raise ValueError(
                f"{path}: tensor {t.name} has unknown GGML type id {t.qtype}"
            ) from None
        if qtype not in readable:
            raise ValueError(
                f"{path}: tensor {t.name} is stored as {qtype.name}, which fleetserve cannot "
                f"read; supported: {sorted(q.name for q in readable)}"
            )


def resolve_gguf(path: str) -> ModelSource:
    path = os.path.abspath(path)
    meta, tensors = read_gguf(path)
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError(f"{path} has no token_embd.weight tensor; not a language model GGUF")
    if "tokenizer.ggml.model" not in meta:
        raise ValueError(f"{path} carries no tokenizer (no tokenizer.ggml.model field)")
    arch = meta.get("general.architecture", "")
    check_tensor_types(path, tensors)
    names = {n for t in tensors if (n := hf_tensor_name(t.name, arch)) is not None}
    hf_config = gguf_hf_config(meta, names, vocab_rows=embed.shape[0])
    weights = GGUFWeights(
        tensors,
        meta["general.architecture"],
        hf_config["num_attention_heads"],
        hf_config["num_key_value_heads"],
    )
    eos = hf_config["eos_token_id"]
    return ModelSource(
        path=path,
        hf_config=hf_config,
        tokenizer_dir=gguf_tokenizer_dir(path, meta.get("tokenizer.chat_template")),
        weights=weights,
        format="gguf",
        generation_config={"eos_token_id": eos} if eos is not None else {},
    )
