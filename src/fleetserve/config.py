"""Frozen configuration dataclasses shared by every layer.

User-facing mistakes raise ValueError naming the field and its allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetserve.core.config import SchedulerConfig
from fleetserve.lora.config import LoRAConfig
from fleetserve.moe_config import MOE_ARCHITECTURES, MoEConfig, moe_from_hf, refuse_unsupported
from fleetserve.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

__all__ = ["SchedulerConfig"]

# Names a dtype may be given by -> its canonical name (torch's attribute). The configs keep
# the name, so the API process resolves an engine's config without importing torch.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
    "Gemma3ForCausalLM",
)


def layer_windows(hf: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: it attends to everything), as transformers
    reads the config: Mistral windows every layer; Qwen2/3 the layers from
    `max_window_layers` on when `use_sliding_window`; Gemma 3 its "sliding_attention"
    layers (`layer_types`, else every layer but each `sliding_window_pattern`-th)."""
    window = hf.get("sliding_window")
    qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    if arch in qwen and not hf.get("use_sliding_window"):
        window = None
    if window is None:
        return (None,) * num_layers
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    types = hf.get("layer_types")
    if types is None:
        if arch == "MistralForCausalLM":
            types = ["sliding_attention"] * num_layers
        elif arch == "Gemma3ForCausalLM":
            pattern = int(hf.get("sliding_window_pattern", 6))
            types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            start = int(hf.get("max_window_layers", num_layers))
            types = [
                "sliding_attention" if i >= start else "full_attention" for i in range(num_layers)
            ]
        else:
            raise ValueError(f"{arch} with sliding_window={window} is not supported")
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"layer_types must list 'sliding_attention' / 'full_attention' for each of the "
            f"{num_layers} layers, got {types!r}"
        )
    return tuple(window if t == "sliding_attention" else None for t in types)


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name (float32, float16, bfloat16) of a dtype given by name or as a
    torch.dtype; "auto" is float32. ValueError for anything else."""
    if not isinstance(dtype, str):  # a torch.dtype
        name = str(dtype).removeprefix("torch.")
        if name not in _ITEM_BYTES:
            raise ValueError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
        return name
    if dtype == "auto":
        return "float32"
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"dtype must be one of {sorted(set(_DTYPES))} or 'auto', got {dtype!r}"
        ) from None


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch.dtype of `dtype_name(dtype)`."""
    import torch

    dt: torch.dtype = getattr(torch, dtype_name(dtype))
    return dt


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype_name: str  # float32 | float16 | bfloat16 (`dtype` is its torch.dtype)
    max_model_len: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # mixture-of-experts fields (moe_config.py); None: dense
    # Per layer: its sliding window in tokens, None for full attention (empty: all full).
    layer_windows: tuple[int | None, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(
        cls,
        hf: dict[str, Any],
        dtype: str | torch.dtype = "float32",
        max_model_len: int | None = None,
    ) -> ModelConfig:
        archs = hf.get("architectures") or []
        if "Gemma3ForConditionalGeneration" in archs and isinstance(hf.get("text_config"), dict):
            # The text part only: its language model's weights (models/loader.py).
            tied = hf.get("tie_word_embeddings", hf["text_config"].get("tie_word_embeddings", True))
            hf = {
                **hf["text_config"],
                "architectures": ["Gemma3ForCausalLM"],
                "tie_word_embeddings": tied,  # the outer model's head is the one used
            }
            archs = hf["architectures"]
        refuse_unsupported(archs)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // heads
        max_pos = int(hf.get("max_position_embeddings", 2048))
        if max_model_len is None:
            max_model_len = max_pos
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters")
        if isinstance(rope_params, dict):
            # transformers >= 5 folds rope_theta/rope_scaling into rope_parameters.
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = rope_params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM"
            or (arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True)))
            or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            dtype_name=dtype_name(dtype),
            max_model_len=max_model_len,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe_from_hf(arch, hf, int(hf["num_hidden_layers"]))
            if arch in MOE_ARCHITECTURES
            else None,
            layer_windows=layer_windows(hf, arch, int(hf["num_hidden_layers"])),
            hf_config=dict(hf),
        )

    @property
    def dtype(self) -> torch.dtype:
        """The weights' and activations' torch.dtype (torch is imported on first use)."""
        return parse_dtype(self.dtype_name)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes per token over every layer, in the model's dtype."""
        return self.kv_bytes_per_token_in(self.dtype_name)

    def kv_bytes_per_token_in(self, kv_dtype: str | torch.dtype) -> int:
        """K and V bytes per token over every layer, in a cache of `kv_dtype`."""
        elem = _ITEM_BYTES[dtype_name(kv_dtype)]
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_kv_blocks is None
    enable_prefix_caching: bool = True
    # Sliding-window layers give back the blocks that slid out of their window (False
    # keeps them, as full-attention layers do: the A/B of docs/benchmarks.md).
    free_window_blocks: bool = True
    # What the KV cache holds: "auto" (the compute dtype: bf16 for a model with bf16
    # weights, else the model's dtype), "float32" or "bfloat16" (EngineConfig.kv_dtype).
    # EngineArgs with `dtype auto` resolves "auto" to "bfloat16" for quantized weights on
    # a CPU with native bf16 (engine/dtype_choice.py).
    kv_cache_dtype: str = "auto"
    # K/V bytes per token of a speculative draft model's cache (in the same dtype), which
    # holds the same block ids beside the target's: a block costs both (0: no draft).
    draft_kv_bytes_per_token: int = 0

    DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
    KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory!r}")
        if not isinstance(self.draft_kv_bytes_per_token, int) or self.draft_kv_bytes_per_token < 0:
            raise ValueError(
                "draft_kv_bytes_per_token must be an integer >= 0, got "
                f"{self.draft_kv_bytes_per_token!r}"
            )
        if self.kv_cache_dtype not in self.KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {self.KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )

    def resolve_num_blocks(
        self, model: ModelConfig, max_num_seqs: int, kv_dtype: torch.dtype | None = None
    ) -> int:
        """Blocks of the KV cache; `kv_dtype` (EngineConfig.kv_dtype) sizes a block
        (None: the model's dtype), with a draft model's K/V for the same tokens where
        there is one (the memory budget holds both caches)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        per_token = model.kv_bytes_per_token_in(kv_dtype or model.dtype)
        per_block = (per_token + self.draft_kv_bytes_per_token) * self.block_size
        if self.kv_cache_memory is not None:
            budget = self.kv_cache_memory
        else:
            # Never more than every sequence at full length would need.
            full = max_num_seqs * -(-model.max_model_len // self.block_size) * per_block
            budget = min(self.DEFAULT_KV_CACHE_MEMORY, full)
        num = budget // per_block
        if num < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds no block of {per_block} bytes; raise it"
            )
        return int(num)

    def resolve_sliding_blocks(
        self, model: ModelConfig, scheduler: SchedulerConfig, num_blocks: int
    ) -> int:
        """Blocks of the sliding-window layers' own pool, for a model with both local and
        global layers (0 for any other model: every layer uses the `num_blocks` pool).

        A request's live window blocks at an allocation are at most those of W - 1 keys
        before its chunk, the chunk (max_num_batched_tokens) and the lookahead, plus two
        partial blocks; the pool holds that for max_num_seqs requests, never more blocks
        than the global pool.
        """
        window = sliding_window_of(model)
        if window is None or all(model.layer_windows):
            return 0
        if not self.free_window_blocks:
            return num_blocks
        tokens = window - 1 + scheduler.max_num_batched_tokens + scheduler.num_lookahead_tokens
        per_seq = -(-tokens // self.block_size) + 2
        return min(num_blocks, scheduler.max_num_seqs * per_seq)


def sliding_window_of(model: ModelConfig) -> int | None:
    """The model's one sliding window (None: no layer has one); ValueError for several."""
    windows = {w for w in model.layer_windows if w is not None}
    if len(windows) > 1:
        raise ValueError(
            f"layers with different sliding windows {sorted(windows)} are not supported"
        )
    return windows.pop() if windows else None


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # MoE models: each TP rank holds whole experts (num_experts / tp of them) instead of
    # a slice of every expert (models/moe_sharding.py).
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError("expert_parallel needs tensor_parallel_size >= 2")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


ATTENTION_BACKENDS = ("auto", "cpu", "torch")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None
    # "auto": the C kernel on the CPU in float32, else plain torch; "cpu" | "torch" force.
    attention_backend: str = "auto"
    speculative: SpeculativeConfig | None = None
    # Resolved weight quantization: "none" | "gguf" | "int8" (models/quantize.py).
    quantization: str = "none"
    # Decode-sized GEMMs of Q4_0/Q4_1/Q8_0 weights quantize their input rows to int8
    # (integer dot products, kernels/quant_dot.h); resolved from EngineArgs.
    int8_activations: bool = False
    # Linear layers keep bf16 weights and multiply through kernels/gemm_bf16.c (float32
    # activations, norms and attention; the KV cache bf16 unless `cache.kv_cache_dtype`
    # says otherwise; the C step with them): a float32 model
    # on the CPU, one process, unquantized (issue 25 item 1; `dtype auto` picks it on
    # CPUs with native bf16: engine/dtype_choice.py).
    bf16_weights: bool = False
    # LoRA adapters beside the base model (None: off; requests naming one are refused).
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.quantization not in ("none", "gguf", "int8"):
            raise ValueError(
                f"quantization must be 'none', 'gguf' or 'int8', got {self.quantization!r}"
            )
        if self.int8_activations and self.quantization == "none":
            raise ValueError("int8_activations needs quantization 'gguf' or 'int8'")
        if self.bf16_weights and (
            self.quantization != "none"
            or self.model.dtype_name != "float32"
            or self.device != "cpu"
            or self.parallel.tensor_parallel_size * self.parallel.pipeline_parallel_size > 1
        ):
            raise ValueError(
                "bf16_weights needs an unquantized float32 model on the CPU in one process"
            )

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: `cache.kv_cache_dtype`, where "auto" is the compute
        dtype (bf16 with bf16 weights, as HF's bf16 model keeps its cache; else the
        model's dtype)."""
        name = self.cache.kv_cache_dtype
        if name == "auto":
            return parse_dtype("bfloat16") if self.bf16_weights else self.model.dtype
        return parse_dtype(name)


def model_root(model_path: str, served_name: str) -> str:
    """/v1/models' `root` for a model: its folder (HF-style), or its served name when it
    is one .gguf file, which no client can load as a tokenizer."""
    return served_name if model_path.endswith(".gguf") else model_path
