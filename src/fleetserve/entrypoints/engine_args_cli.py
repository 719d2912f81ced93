"""Command-line flags shared by every command that builds an engine."""

from __future__ import annotations

import argparse

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.lora.config import LORA_DTYPES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2)")
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto (what this CPU runs fastest; logged at start-up) | float32 | bfloat16 | float16",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="what the KV cache holds; auto: the compute dtype (bfloat16 with bf16 weights)",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu", "torch"],
        help="cpu: the C paged-attention kernel (float32 on the CPU); torch: plain SDPA",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument(
        "--expert-parallel",
        action="store_true",
        help="MoE models: each tensor-parallel rank holds whole experts (num_experts / tp) "
        "instead of a slice of every expert",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"model": DRAFT_PATH, "num_speculative_tokens": 4}\'',
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["none", "gguf", "int8"],
        help="weights: gguf = keep a GGUF file's blocks (the default for .gguf on one CPU "
        "process), int8 = int8 made at load, none = dequantized to --dtype",
    )
    g.add_argument(
        "--bf16-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="float32 model on the CPU: linear layers keep bf16 weights (half the bytes) and "
        "multiply through the bf16 kernels (AVX512-BF16 / AMX where present), the rest "
        "float32. Default: as --dtype auto picks (on where the CPU has native bf16)",
    )
    g.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --quantization gguf/int8: quantize the inputs of decode-sized matmuls "
        "to int8 too (integer dot products; W8A8 for int8). Default: on for gguf where "
        "the kernels have AVX-512 VNNI (FLEETSERVE_INT8_ACTIVATIONS=0/1 overrides)",
    )
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters served under their own names (a request names one as its model)",
    )
    lora.add_argument("--max-loras", type=int, default=1, help="adapters in one step")
    lora.add_argument("--max-lora-rank", type=int, default=16)
    lora.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept loaded (default: max-loras)"
    )
    lora.add_argument(
        "--lora-dtype",
        choices=LORA_DTYPES,
        default="auto",
        help="how adapter weights are stored (auto: bfloat16 with the C kernel, float math)",
    )


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        device=args.device,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        expert_parallel=args.expert_parallel,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
        bf16_weights=args.bf16_weights,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=args.lora_modules,
        lora_dtype=args.lora_dtype,
    )
