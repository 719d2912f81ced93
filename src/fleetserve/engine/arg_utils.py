"""User-facing engine arguments -> frozen EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from fleetserve.core.config import SchedulerConfig
from fleetserve.engine.dtype_choice import (
    BF16_KV_CACHE_WHY,
    DtypeChoice,
    announce,
    choose_dtype,
    cpu_flags,
)
from fleetserve.lora.config import LoRAConfig, parse_lora_modules
from fleetserve.models.loader import ModelSource, resolve_model
from fleetserve.models.quant_choice import resolve_int8_activations, resolve_quantization
from fleetserve.spec_decode.config import SpeculativeConfig

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class EngineArgs:
    model: str | None = None
    # "auto": what this CPU runs fastest for the checkpoint, said at start-up
    # (engine/dtype_choice.py: float32, with bf16 weights where the CPU has native bf16).
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    # "auto" (with `dtype auto` on a CPU with native bf16: bf16 for bf16 weights and for
    # quantized ones; else the model's dtype), "float32" or "bfloat16".
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    # Sliding-window layers free the blocks that slid out of their window (False: keep
    # them, the baseline of the KV-memory measurement in docs/benchmarks.md).
    free_window_blocks: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # MoE models: split whole experts across the TP ranks instead of slicing every expert.
    expert_parallel: bool = False
    # {"method": "ngram", "num_speculative_tokens": K, ...} or {"model": PATH, ...}
    # (a dict, or its JSON text); see spec_decode/config.py.
    speculative_config: dict[str, Any] | str | None = None
    # None: a GGUF checkpoint's weights stay quantized where they can (one CPU process,
    # float32), anything else runs in `dtype`; "none" | "gguf" | "int8" ask explicitly.
    quantization: str | None = None
    # Int8 activations with quantized weights (W8A8 for int8/Q8_0): None picks the
    # default for the quantization (models/quantize.py: resolve_int8_activations).
    int8_activations: bool | None = None
    # Linear layers store bf16 weights (kernels/gemm_bf16.c): see EngineConfig. None: as
    # `dtype auto` picks (bf16 on CPUs with native bf16); True / False ask explicitly.
    bf16_weights: bool | None = None
    # LoRA adapters (vLLM's flags): on with enable_lora; `lora_modules` names adapters
    # known from the start ({"name": "path"} or ["name=path", ...]).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | list[str] | None = None
    lora_dtype: str = "auto"

    def resolve_lora(self) -> LoRAConfig | None:
        modules = parse_lora_modules(self.lora_modules)
        if not self.enable_lora:
            if modules:
                raise ValueError("lora_modules needs enable_lora=True")
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            modules=modules,
            lora_dtype=self.lora_dtype,
        )

    def resolve(self) -> tuple[EngineConfig, ModelSource]:
        path = self.model
        if path is None:
            from fleetserve.models.default_model import default_model_path

            path = default_model_path()
        else:
            from fleetserve.models.default_model import packaged_model_path

            path = packaged_model_path(path) or path
        source = resolve_model(path)
        hf = source.hf_config
        max_len = self.max_model_len
        if max_len is None:
            max_len = min(int(hf.get("max_position_embeddings", 2048)), DEFAULT_MAX_MODEL_LEN)
        dtype = self.dtype
        choice: DtypeChoice | None = None
        if dtype == "auto":
            stored = hf.get("torch_dtype") or hf.get("dtype")
            choice = choose_dtype(stored, cpu_flags(), self.device)
            dtype = choice.dtype
        model_cfg = ModelConfig.from_hf(hf, dtype=dtype, max_model_len=max_len)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        spec = SpeculativeConfig.parse(self.speculative_config)
        quantization = resolve_quantization(
            self.quantization,
            source.format,
            model_cfg.dtype_name,
            self.device,
            self.tensor_parallel_size * self.pipeline_parallel_size,
        )
        lora = self.resolve_lora()
        bf16_weights = bool(self.bf16_weights)
        kv_cache_dtype = self.kv_cache_dtype
        if choice is not None:
            native_bf16 = choice.bf16_weights  # this CPU has native bf16 and auto may use it
            if choice.bf16_weights:
                blocker = self._bf16_blocker(model_cfg, quantization, lora)
                if blocker:
                    choice = choice.without_bf16(blocker)
            bf16_weights = choice.bf16_weights if self.bf16_weights is None else bf16_weights
            if native_bf16 and not bf16_weights and self._bf16_kv_cache_pays(quantization):
                choice = choice.with_bf16_kv_cache(BF16_KV_CACHE_WHY)
                kv_cache_dtype = "bfloat16"
            announce(choice)
        # Slots for a lone stream's speculative bursts: only where the runner can run them
        # (one process, no LoRA: worker/spec_burst.py).
        one_process = self.tensor_parallel_size * self.pipeline_parallel_size == 1
        burst_slots = spec.num_burst_lookahead_tokens if spec and one_process and not lora else 0
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 1024 if self.enable_chunked_prefill else max_len
        config = EngineConfig(
            model_path=path,
            model=model_cfg,
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory=self.kv_cache_memory,
                kv_cache_dtype=kv_cache_dtype,
                enable_prefix_caching=self.enable_prefix_caching,
                free_window_blocks=self.free_window_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_len,
                chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
                num_burst_lookahead_tokens=burst_slots,
                max_loras=lora.max_loras if lora else None,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                expert_parallel=self.expert_parallel,
            ),
            seed=self.seed,
            device=self.device,
            num_threads=self.num_threads,
            attention_backend=self.attention_backend,
            speculative=spec,
            quantization=quantization,
            int8_activations=resolve_int8_activations(self.int8_activations, quantization),
            bf16_weights=bf16_weights,
            lora=lora,
        )
        if spec is not None and spec.method == "draft_model":
            from fleetserve.spec_decode.draft_model import check_draft_model, with_draft_kv_budget

            config = with_draft_kv_budget(config, check_draft_model(config, source))
        return config, source

    def _bf16_kv_cache_pays(self, quantization: str) -> bool:
        """Whether `kv_cache_dtype` auto gives quantized weights a bf16 cache (on a CPU with
        native bf16, where `dtype auto` would have taken bf16 weights): the decode
        attention of a served step reads half the bytes through the CPU kernels."""
        return (
            self.kv_cache_dtype == "auto"
            and quantization != "none"
            and self.attention_backend != "torch"
        )

    def _bf16_blocker(
        self, model_cfg: ModelConfig, quantization: str, lora: LoRAConfig | None
    ) -> str | None:
        """Why `dtype auto`'s bf16 weights cannot run with these settings (None: they can)."""
        if self.bf16_weights is False:
            return "bf16 weights turned off"
        if quantization != "none":
            return f"{quantization} weights keep their quantized path"
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            return "tensor/pipeline-parallel ranks run float32 weights"
        if lora is not None:
            return "LoRA adapters run beside float32 base weights"
        if model_cfg.moe is not None:
            return "mixture-of-experts weights have no bf16 path"
        if self.attention_backend == "torch":
            return "the torch attention backend runs no CPU kernels"
        if not model_cfg.architecture.endswith("ForCausalLM"):
            return f"{model_cfg.architecture} is not a causal LM"
        from fleetserve.kernels import library  # torch-free: the API process asks too

        if library.open_library() is None:
            return "no C compiler for the CPU kernels"
        if not library.bf16_native():
            return "the kernel library was built without AVX512-BF16"
        return None
