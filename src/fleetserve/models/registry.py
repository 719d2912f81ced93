"""Architecture name -> model class."""

from __future__ import annotations

from fleetserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from fleetserve.models.gemma3 import Gemma3ForCausalLM
from fleetserve.models.llama import LlamaForCausalLM
from fleetserve.models.moe import MoeForCausalLM
from fleetserve.moe_config import MOE_ARCHITECTURES

# Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm) differ from Llama only by config flags.
_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES
}
# Mixtral, Qwen2-MoE and Qwen3-MoE: the same decoder with MoE blocks (models/moe.py).
_REGISTRY.update({arch: MoeForCausalLM for arch in MOE_ARCHITECTURES})
_REGISTRY["Gemma3ForCausalLM"] = Gemma3ForCausalLM


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}") from None
