"""Building a model and its paged KV cache on a device (the runner's and a draft model's)."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from fleetserve.config import ModelConfig
from fleetserve.distributed.parallel_state import ParallelContext
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import LEAD_CHUNK_BYTES, LEAD_SPIN_US
from fleetserve.layers.linear import linears_to_bf16
from fleetserve.models.llama import LlamaForCausalLM
from fleetserve.models.llama_decode import build_decode_plan
from fleetserve.models.loader import ModelSource
from fleetserve.models.moe import MoeForCausalLM
from fleetserve.models.moe_quant import keep_gguf_experts_quantized
from fleetserve.models.quantize import keep_gguf_quantized, quantize_int8
from fleetserve.models.registry import model_class
from fleetserve.models.sharding import load_shards, shard_model

M = TypeVar("M", bound=torch.nn.Module)


class _NoInitOnMeta(TorchFunctionMode):
    """`torch.nn.init` calls left out while a model is built on the meta device: the
    weights are loaded over them anyway, and on meta tensors torch runs them through its
    Python reference ops, whose first use imports torch._dynamo (~1.5 s of CPU per engine
    process, quiet)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _materialize(model: M, device: torch.device) -> M:
    """`model.to_empty(device=device)`, by `torch.empty` of each tensor's shape and dtype:
    to_empty's `empty_like` of a meta tensor runs torch's reference op, which imports
    torch's symbolic shapes and sympy (~0.6 s of CPU, quiet) on first use."""

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    model._apply(fresh)
    return model


def load_model(
    mcfg: ModelConfig,
    source: ModelSource,
    device: torch.device,
    parallel: ParallelContext | None = None,
    quantization: str = "none",
    int8_activations: bool = False,
) -> LlamaForCausalLM:
    """Built on the meta device, materialized on `device`, weights loaded (this rank's
    shards under `parallel`), quantized as `quantization` says ("none" | "gguf" | "int8",
    resolved by EngineArgs; `int8_activations` with it), in eval mode."""
    with torch.device("meta"), _NoInitOnMeta():
        model = model_class(mcfg)(mcfg)
        if parallel is not None:
            shard_model(model, parallel)
    # Quantized layers are swapped in before allocation: no float32 copy is made.
    consumed = set()
    if quantization == "gguf":
        consumed = keep_gguf_quantized(model, source, int8_activations)
        if isinstance(model, MoeForCausalLM):
            consumed |= keep_gguf_experts_quantized(model, source, int8_activations)
    model = _materialize(model, device).to(mcfg.dtype)
    # Buffers (rotary tables) were on meta: rebuild them for real.
    model.rebuild_rope(device)
    if parallel is None:
        model.load_weights(source.iter_tensors(mcfg.dtype, skip=consumed))
    else:
        load_shards(model, source, parallel)
    if quantization == "int8":
        quantize_int8(model, int8_activations)
    return model.eval()


def bind_kv_caches(
    model: LlamaForCausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    use_cpu_kernel: bool,
    num_sliding_blocks: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate each attention layer's K/V cache and bind it to the layer; with
    `num_sliding_blocks`, the sliding-window layers' caches hold that many blocks (their
    own pool, core/hybrid_blocks.py)."""
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    for attn in model.attention_layers():
        n = num_sliding_blocks if num_sliding_blocks and attn.sliding_window else num_blocks
        shape = (n, attn.num_kv_heads, block_size, attn.head_dim)
        if use_cpu_kernel:
            # The kernels' layout (keys d-major within a block), on huge pages where
            # the OS allows: decodes stream the cache every step. Zero, and written now
            # (unless FLEETSERVE_KV_PREFAULT=0), so its pages are faulted in at start-up:
            # left to the first writes, the faults cost as much (1.2 s for the bench's
            # 1.15 GB) inside the first requests.
            k_shape, v_shape = cpu_kernels.kv_cache_shapes(*shape)
            prefault = cpu_kernels.kv_prefault()
            k = cpu_kernels.zeroed_huge(*k_shape, dtype=dtype, prefault=prefault)
            v = cpu_kernels.zeroed_huge(*v_shape, dtype=dtype, prefault=prefault)
        else:
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros(shape, dtype=dtype, device=device)
        attn.k_cache, attn.v_cache = k, v
        caches.append((k, v))
    return caches


def use_cpu_kernel(mcfg: ModelConfig, device: torch.device, attention_backend: str) -> bool:
    """Attend from the paged cache in place with the C kernel where it applies (and run
    the fused C norms, rotary and silu*mul beside it)."""
    return (
        device.type == "cpu"
        and mcfg.dtype == torch.float32
        and attention_backend in ("auto", "cpu")
        and cpu_kernels.load() is not None
    )


def bind_decode_plan(model: LlamaForCausalLM, cpu_kernel: bool, enabled: bool) -> bool:
    """Give the model its C decode step (models/llama_decode.py) where it applies; call
    after `bind_kv_caches` and `pack_for_cpu`. Returns whether it did."""
    enabled = enabled and model.decode_step_capable
    plan = build_decode_plan(model) if cpu_kernel and enabled else None
    if plan is not None and not split_steps_enabled():
        plan.split_min_rows = 0
    if plan is not None:
        plan.lead_max_rows = lead_max_rows(plan.lead_max_rows)
        plan.lead_share = lead_share(plan.lead_share)
        plan.lead_multi = lead_multi(plan.lead_multi)
        plan.tune_lead_share(lead_spin_us(LEAD_SPIN_US), LEAD_CHUNK_BYTES)
        plan.lead_prefetch_bytes = lead_prefetch_bytes(plan.lead_prefetch_bytes)
    model.model.decode_plan = plan
    return plan is not None


def fused_decode_enabled() -> bool:
    """FLEETSERVE_FUSED_DECODE=0 keeps every step on the module path (A/B runs, bisects)."""
    return os.environ.get("FLEETSERVE_FUSED_DECODE", "1") != "0"


def _env_count(name: str, default: int, unit: str) -> int:
    """The integer >= 0 in environment variable `name`, or `default` when unset; a
    ValueError naming it (and its `unit`) for anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name} must be {unit} >= 0, got {raw!r}")
    return int(raw)


def _env_names(name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """The comma-separated names in environment variable `name` ("none": no name), or
    `default` when unset (the plan's setter checks each name)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    return () if names == ("none",) else names


def lead_max_rows(default: int) -> int:
    """FLEETSERVE_LEAD_STEPS=N: steps of up to N rows (and 4 sequences) on 2 threads run as lead
    steps (DecodePlan.lead_max_rows), 0: none (every step as a team); A/B runs."""
    return _env_count("FLEETSERVE_LEAD_STEPS", default, "a row count")


def lead_share(default: tuple[str, ...]) -> tuple[str, ...]:
    """FLEETSERVE_LEAD_SHARE=gate_up,down: the projections a lead step's second thread takes
    a share of (DecodePlan.lead_share; "none": the layers on one thread); A/B runs."""
    return _env_names("FLEETSERVE_LEAD_SHARE", default)


def lead_multi(default: tuple[str, ...]) -> tuple[str, ...]:
    """FLEETSERVE_LEAD_MULTI=qkv,o,gate_up,down,heads,attention: what a lead step of several
    rows shares with its second thread (DecodePlan.lead_multi; "none": as a one-row lead
    step); A/B runs."""
    return _env_names("FLEETSERVE_LEAD_MULTI", default)


def lead_spin_us(default: int) -> int:
    """FLEETSERVE_LEAD_SPIN_US=N: how long a lead step's second thread spins after a shared
    GEMV before it sleeps (DecodePlan.tune_lead_share); A/B runs."""
    return _env_count("FLEETSERVE_LEAD_SPIN_US", default, "microseconds")


def lead_prefetch_bytes(default: int) -> int:
    """FLEETSERVE_LEAD_PREFETCH_KB=N: KiB of each coming shared GEMV's tail a one-row lead
    step's second thread reads ahead (DecodePlan.lead_prefetch_bytes; 0: none); A/B runs."""
    return _env_count("FLEETSERVE_LEAD_PREFETCH_KB", default // 1024, "KiB") * 1024


def split_steps_enabled() -> bool:
    """FLEETSERVE_SPLIT_STEPS=0 runs every C step as one team of threads, never split by
    sequences (DecodePlan.split_min_rows; A/B runs on a quiet machine)."""
    return os.environ.get("FLEETSERVE_SPLIT_STEPS", "1") != "0"


def pack_for_cpu(model: LlamaForCausalLM, cpu_kernel: bool, bf16: bool = False) -> None:
    if cpu_kernel and bf16:
        if cpu_kernels.load() is None:
            raise ValueError("bf16_weights needs the CPU kernels (a C compiler)")
        # Linear layers keep bf16 weights (gemm_bf16.c); a tied head stays packed below.
        linears_to_bf16(model)
    if cpu_kernel and cpu_kernels.gemm_worthwhile():
        # Weights move into the CPU GEMM kernel's panel layout (layers/linear.py).
        model.pack_for_cpu()
