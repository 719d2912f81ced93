"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE.

They are the Llama family (models/llama.py) with the MLP of some layers replaced by a
`SparseMoeBlock`: a router picks each token's top-k experts (softmax, then top-k,
renormalised if the config says so), each expert is a SiLU-gated MLP, and Qwen2-MoE adds
an always-on shared expert gated by ``sigmoid(shared_expert_gate(x))``. The routed
experts run grouped by expert (kernels/moe.py): one GEMM per expert over its tokens.

Under tensor parallelism (models/moe_sharding.py) the block holds either a slice of every
expert (plain TP) or whole experts of its own (expert parallelism); either way its output
is a partial sum that one all-reduce completes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from fleetserve.config import ModelConfig
from fleetserve.distributed.parallel_state import ParallelContext
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.moe import ExpertWeights, grouped_experts, grouped_experts_torch
from fleetserve.layers.linear import Linear
from fleetserve.models.llama import _FUSED, GatedMLP, LlamaForCausalLM
from fleetserve.moe_config import MoEConfig


class SharedExpertMLP(GatedMLP):
    """A SiLU-gated MLP whose output the block all-reduces (no reduction of its own)."""


class MoEExperts(nn.Module):
    """Experts [first_expert, first_expert + num_local) of one layer, each a SiLU-gated MLP
    of `intermediate_size` (this rank's slice of it under plain TP). HF v5's layout:
    gate_up_proj [num_local, 2 * inter, hidden] (gate rows first), down_proj
    [num_local, hidden, inter]."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_local: int, first_expert: int = 0
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_local = num_local
        self.first_expert = first_expert
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size))
        # The C kernel's weights once packed or kept quantized (None: the torch reference).
        self.kernel_weights: ExpertWeights | None = None

    def pack_for_cpu(self) -> None:
        """Each expert's projections into gemm.c's panels; the 3-D copies are dropped."""
        if self.kernel_weights is not None:
            return
        w13, w2 = self.gate_up_proj.detach(), self.down_proj.detach()
        self.kernel_weights = ExpertWeights(
            gate_up=[[cpu_kernels.PackedWeight(w13[e])] for e in range(self.num_local)],
            down=[cpu_kernels.PackedWeight(w2[e]) for e in range(self.num_local)],
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
        )
        self.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.kernel_weights is not None:
            return grouped_experts(
                x, topk_ids, topk_weights, self.kernel_weights, self.first_expert
            )
        return grouped_experts_torch(
            x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj, self.first_expert
        )

    def extra_repr(self) -> str:
        return (
            f"experts=[{self.first_expert}, {self.first_expert + self.num_local}), "
            f"hidden={self.hidden_size}, inter={self.intermediate_size}"
        )


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] float32, expert ids [T, K]): softmax over all experts in float32,
    then the top k, optionally rescaled to sum to 1 (HF's order of operations)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# The block's gates: they pick experts, so they stay float32 under int8 quantization.
ROUTERS = ("gate", "shared_expert_gate")


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = MoEExperts(cfg.hidden_size, moe.moe_intermediate_size, moe.num_experts)
        self.shared_expert: SharedExpertMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size is not None:
            self.shared_expert = SharedExpertMLP(
                cfg.hidden_size, moe.shared_expert_intermediate_size
            )
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        # Set by sharding: the outputs are partial sums across the TP group.
        self.ctx: ParallelContext | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.ctx is not None:
            out = self.ctx.all_reduce(out)
        return out


# Expert tensors of HF checkpoints: per expert (Mixtral's w1/w3/w2, Qwen's *_proj), or
# stacked over experts [num_experts, rows, cols] (a GGUF file's `ffn_*_exps`).
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?:(\d+)\.)?"
    r"(w1|w2|w3|gate_proj|up_proj|down_proj|gate_up_proj)(?:\.weight)?$"
)
# projection name -> (our parameter, shard index within gate_up_proj; None: down_proj)
EXPERT_PROJ = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
    "down_proj": ("down_proj", None),
    "gate_up_proj": ("gate_up_proj", None),  # transformers v5's fused layout, stacked
}


def parse_expert_name(name: str) -> tuple[int, int | None, str, int | None] | None:
    """(layer, expert or None if stacked, our parameter, shard index) of an expert
    tensor's HF name; None for any other tensor."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    param, shard = EXPERT_PROJ[m.group(3)]
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2)), param, shard


def canonical_name(name: str) -> str:
    """Mixtral's `block_sparse_moe.gate` is our `mlp.gate` (the router)."""
    return name.replace(".block_sparse_moe.", ".mlp.")


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} has no mixture-of-experts config")
        self.moe = cfg.moe
        for i in cfg.moe.sparse_layers:
            self.model.layers[i].mlp = SparseMoeBlock(cfg, cfg.moe)  # type: ignore[assignment]

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [d.mlp for d in self.decoder_layers() if isinstance(d.mlp, SparseMoeBlock)]

    def pack_for_cpu(self) -> None:
        super().pack_for_cpu()
        for block in self.moe_blocks():
            block.experts.pack_for_cpu()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            expert = parse_expert_name(name)
            if expert is not None:
                self._load_expert(params, expert, name, tensor, filled)
                continue
            name = canonical_name(name)
            parts = name.split(".")
            target, offset, size = name, 0, None
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                if fused == "qkv_proj":
                    sizes = self._shard_sizes(fused)
                else:  # dense or shared-expert gate/up: halves of the fused rows
                    rows = params[target].shape[0] if target in params else 0
                    sizes = [rows // 2, rows // 2]
                offset, size = sum(sizes[:shard]), sizes[shard]
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            dest = param.data if size is None else param.data.narrow(0, offset, size)
            _copy(name, dest, tensor)
            filled.add(name if size is not None else target)
        missing = sorted(self._expected_names(params) - filled)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _load_expert(
        self,
        params: dict[str, nn.Parameter],
        expert: tuple[int, int | None, str, int | None],
        name: str,
        tensor: torch.Tensor,
        filled: set[str],
    ) -> None:
        layer, e, pname, shard = expert
        target = f"model.layers.{layer}.mlp.experts.{pname}"
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        inter = self.moe.moe_intermediate_size
        dest = param.data if shard is None else param.data.narrow(1, shard * inter, inter)
        shards = [0, 1] if pname == "gate_up_proj" and shard is None else [shard]
        experts = range(param.shape[0]) if e is None else [e]
        _copy(name, dest if e is None else dest[e], tensor)
        filled.update(_expert_key(layer, i, pname, s) for i in experts for s in shards)

    def _expected_names(self, params: dict[str, nn.Parameter]) -> set[str]:
        expected: set[str] = set()
        for pname, param in params.items():
            parts = pname.split(".")
            if len(parts) >= 2 and parts[-2] == "experts":
                layer = int(parts[2])
                for e in range(param.shape[0]):
                    if parts[-1] == "gate_up_proj":
                        expected.add(_expert_key(layer, e, "gate_up_proj", 0))
                        expected.add(_expert_key(layer, e, "gate_up_proj", 1))
                    else:
                        expected.add(_expert_key(layer, e, "down_proj", None))
                continue
            fused = parts[-2] if len(parts) >= 2 else ""
            if fused in ("qkv_proj", "gate_up_proj"):
                for hf, (f, _) in _FUSED.items():
                    if f == fused:
                        expected.add(".".join(parts[:-2] + [hf, parts[-1]]))
            else:
                expected.add(pname)
        return expected


def _expert_key(layer: int, expert: int, param: str, shard: int | None) -> str:
    return f"layer {layer} expert {expert} {param}[{shard}]"


def _copy(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(dest.shape)}"
        )
    dest.copy_(tensor)
