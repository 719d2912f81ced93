"""Architecture name -> model class."""

from __future__ import annotations

from fleetserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from fleetserve.models.gemma3 import Gemma3ForCausalLM
from fleetserve.models.llama import LlamaForCausalLM

# Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm) differ from Llama only by config flags.
_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES
}
_REGISTRY["Gemma3ForCausalLM"] = Gemma3ForCausalLM


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}") from None
