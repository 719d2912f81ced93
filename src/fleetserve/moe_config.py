"""Mixture-of-experts fields of a model config (Mixtral, Qwen2-MoE, Qwen3-MoE).

`ModelConfig.moe` holds one `MoEConfig` for these architectures and None for dense ones.
MoE architectures fleetserve does not run (DeepSeek's latent attention, grouped routing)
are refused by name rather than loaded as something they are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# Known MoE architectures that are not implemented, with what is missing.
UNSUPPORTED_MOE = {
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA) and grouped top-k routing",
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA) and sigmoid grouped routing",
    "DeepseekForCausalLM": "DeepSeek-MoE's fine-grained experts and dense first layers",
    "Glm4MoeForCausalLM": "sigmoid routing with expert bias",
    "OlmoeForCausalLM": "OLMoE's q/k norm over all heads",
    "PhimoeForCausalLM": "sparsemixer routing",
    "GraniteMoeForCausalLM": "Granite's scaled residuals and logits",
    "JambaForCausalLM": "Mamba layers",
    "DbrxForCausalLM": "DBRX's fused experts and clipped qkv",
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each routed expert's
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    # Qwen2-MoE's always-on expert (gated by sigmoid(shared_expert_gate(x))); None: none.
    shared_expert_intermediate_size: int | None
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE block

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )


def refuse_unsupported(archs: list[str]) -> None:
    """ValueError naming a known-but-unsupported MoE architecture among `archs`."""
    for arch in archs:
        if arch in UNSUPPORTED_MOE:
            raise ValueError(
                f"architecture {arch!r} is a mixture of experts fleetserve does not run "
                f"({UNSUPPORTED_MOE[arch]}); supported MoE: {', '.join(MOE_ARCHITECTURES)}"
            )


def moe_from_hf(arch: str, hf: dict[str, Any], num_layers: int) -> MoEConfig:
    """The MoE fields of a config.json of `arch` (one of MOE_ARCHITECTURES)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act must be 'silu', got {act!r}")
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window", arch == "MixtralForCausalLM") and window:
        raise ValueError(
            f"{arch} with sliding_window={window} is not supported (its experts are; the "
            "window is not): set sliding_window to null to attend to the whole context"
        )
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=int(hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            shared_expert_intermediate_size=None,
            sparse_layers=tuple(range(num_layers)),
        )
    step = int(hf.get("decoder_sparse_step", 1))
    dense_only = set(hf.get("mlp_only_layers") or ())
    # transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    sparse = tuple(
        i
        for i in range(num_layers)
        if i not in dense_only and num_experts > 0 and step > 0 and (i + 1) % step == 0
    )
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            shared if arch == "Qwen2MoeForCausalLM" and shared > 0 else None
        ),
        sparse_layers=sparse,
    )
