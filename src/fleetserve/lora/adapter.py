"""A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) -> checked tensors.

Every refusal is a ValueError that names the adapter and the problem: not a PEFT LoRA
folder, a rank above `max_lora_rank`, target modules the model has no place for, or
tensors whose shapes do not fit the base model. The scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA; per module with rank_pattern / alpha_pattern) is folded
into B here, so the kernel only multiplies.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fleetserve.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection name -> the fused module of ours it lands in, and its segment there.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# Our LoRA-capable modules, each with its HF projections in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}

_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_(A|B)(?:\.[\w-]+)?\.weight$"
)
_REFUSED_KEYS = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
}


def projection_shape(cfg: ModelConfig, hf_name: str) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection of the base model."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }[hf_name]


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's pair: delta(x) = (x @ a.T) @ b.T, the scaling already in b."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: (layer index, HF projection name) -> its weights."""

    name: str
    path: str
    rank: int  # the largest rank of any module
    weights: dict[tuple[int, str], LoRAWeights] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(w.a.numel() * 4 + w.b.numel() * 4 for w in self.weights.values())

    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})


def read_adapter_config(name: str, path: str) -> dict[str, Any]:
    """The adapter's config, checked to be a PEFT LoRA one that fleetserve can serve."""
    folder = Path(path)
    cfg_file = folder / CONFIG_FILE
    if not folder.is_dir() or not cfg_file.is_file():
        raise ValueError(
            f"LoRA adapter {name!r}: {path!r} is not a PEFT adapter folder (no {CONFIG_FILE})"
        )
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(
            f"LoRA adapter {name!r}: {path!r} has no {WEIGHTS_FILE} "
            "(only safetensors weights are loaded, never pickles)"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold an object")
    peft_type = str(cfg.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise ValueError(
            f"LoRA adapter {name!r}: peft_type is {cfg.get('peft_type')!r}, expected 'LORA'"
        )
    for key, why in _REFUSED_KEYS.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {why}")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise ValueError(f"LoRA adapter {name!r}: {key} must be a positive number")
    return cfg


def _pattern_value(pattern: dict[str, Any], module_key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: a key matches when it ends the module's name."""
    for key, value in pattern.items():
        if re.search(rf"(^|\.){key}$", module_key) or re.fullmatch(key, module_key):
            return float(value)
    return default


def load_adapter(name: str, path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the adapter at `path` against the base model `cfg`."""
    from safetensors import safe_open

    acfg = read_adapter_config(name, path)
    rank_pattern = acfg.get("rank_pattern") or {}
    alpha_pattern = acfg.get("alpha_pattern") or {}
    rslora = bool(acfg.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    keys: dict[tuple[int, str], str] = {}
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for tname in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            m = _TENSOR.match(tname)
            if m is None:
                raise ValueError(
                    f"LoRA adapter {name!r}: tensor {tname!r} targets a module the model "
                    f"has no LoRA place for (supported: {', '.join(TARGETS)})"
                )
            layer, module, which = int(m.group(1)), m.group(2), m.group(3)
            if module not in TARGETS:
                raise ValueError(
                    f"LoRA adapter {name!r}: target module {module!r} is not one of the "
                    f"model's projections ({', '.join(TARGETS)})"
                )
            if cfg.moe is not None and TARGETS[module][0] in ("gate_up_proj", "down_proj"):
                raise ValueError(
                    f"LoRA adapter {name!r}: target module {module!r}: this mixture-of-experts "
                    "model's MLP has no LoRA place (adapters on its attention projections "
                    "q_proj, k_proj, v_proj, o_proj are served)"
                )
            if layer >= cfg.num_hidden_layers:
                raise ValueError(
                    f"LoRA adapter {name!r}: layer {layer} does not exist (the base model "
                    f"has {cfg.num_hidden_layers} layers)"
                )
            pairs.setdefault((layer, module), {})[which] = f.get_tensor(tname).float()
            keys[(layer, module)] = tname.split(".lora_")[0]
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {where} lacks its lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        in_f, out_f = projection_shape(cfg, module)
        r = int(a.shape[0])
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(
                f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, which are not a rank-r pair"
            )
        if r > max_lora_rank:
            raise ValueError(
                f"LoRA adapter {name!r}: rank {r} ({where}) is above max_lora_rank={max_lora_rank}"
            )
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise ValueError(
                f"LoRA adapter {name!r}: {where} is {a.shape[1]} -> {b.shape[0]} features, "
                f"the base model's is {in_f} -> {out_f} (an adapter of another base model?)"
            )
        module_key = keys[(layer, module)].removeprefix("base_model.model.")
        alpha = _pattern_value(alpha_pattern, module_key, float(acfg["lora_alpha"]))
        cfg_r = _pattern_value(rank_pattern, module_key, float(acfg["r"]))
        if int(cfg_r) != r:
            raise ValueError(
                f"LoRA adapter {name!r}: {where} has rank {r}, its config says {int(cfg_r)}"
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        weights[(layer, module)] = LoRAWeights(a.contiguous(), (b * scale).contiguous())
    rank = max(w.rank for w in weights.values())
    return LoRAAdapter(name=name, path=path, rank=rank, weights=weights)
