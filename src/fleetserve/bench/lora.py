"""`fleetserve bench lora`: mixed-adapter throughput and the TTFT of a cold adapter.

1. Throughput: `--streams` greedy streams of `--num-tokens` tokens each, once all on the
   base model and once spread round-robin over `--num-adapters` adapters (max_loras =
   num_adapters, so every adapter rides in every step); output tokens per second of the
   whole batch (offline LLM.generate; base and mixed runs alternate, `--repeats` of each
   after a warm-up; medians), and the median ratio of the pairs.
2. Cold-adapter TTFT through the server's engine path (AsyncEngine + engine-core
   process): the first token of a request on the base model, on an adapter already
   loaded, and on one that must first be read from disk (the load runs in the core's
   loader thread).

Adapters are random PEFT LoRA folders (rank `--rank`, every attention and MLP projection,
non-zero B) written for the model's shapes, so any base (a GGUF file included) works.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fleetserve.config import ModelConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from
from fleetserve.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, projection_shape

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(
    cfg: ModelConfig, out: Path, rank: int, seed: int, targets: tuple[str, ...] = TARGETS
) -> str:
    """A PEFT LoRA folder for a base of `cfg`'s shapes: random A and B (B non-zero)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_hidden_layers):
        for module in targets:
            sub = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            in_f, out_f = projection_shape(cfg, module)
            key = f"base_model.model.model.layers.{layer}.{sub}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (out / CONFIG_FILE).write_text(json.dumps(config))
    return str(out)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--targets",
        default="q_proj,v_proj",
        help="comma-separated projections the adapters train (PEFT's default for Llama: "
        "q_proj,v_proj; 'all' for every attention and MLP projection)",
    )
    p.add_argument("--num-tokens", type=int, default=64, help="greedy tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--json", default=None, help="write the figures here")
    g = p.add_argument_group("served comparison (bench/lora_peers.py)")
    g.add_argument(
        "--compare",
        nargs="+",
        choices=("fleetserve", "vllm"),
        default=None,
        help="serve the workload on these servers (same HF base and adapters), alternately",
    )
    g.add_argument("--rounds", type=int, default=3, help="alternating rounds (--compare)")
    g.add_argument("--vllm-python", default=os.environ.get("FLEETSERVE_VLLM_PYTHON"))
    g.add_argument("--vllm-model", default=None, help="HF folder of the base (default: the "
                   "GGUF --model dequantized into --work-dir)")  # fmt: skip
    g.add_argument("--vllm-dtype", default="auto", help="vLLM's dtype (auto: bf16 here)")
    g.add_argument("--work-dir", default="/tmp/fleetserve-bench-lora")
    g.add_argument("--startup-timeout", type=float, default=900.0)


def _throughput(
    llm: Any, prompts: list[list[int]], loras: list[Any], n: int, reps: int
) -> dict[str, float]:
    """Base and mixed runs alternated (base, mixed, base, mixed, ...) after a warm-up of
    each, so that a shared machine's changing load hits both alike: the medians of output
    tokens per second and of the process's CPU ms per output token (steadier than the wall
    clock), and the median of the per-pair wall ratios."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    items = [{"prompt_token_ids": p} for p in prompts]
    kinds = {"base": [None] * len(prompts), "mixed": loras}
    for lr in kinds.values():
        llm.generate(items, params, lora_request=lr, use_tqdm=False)  # warm-up (and loads)
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(reps):
        for kind, lr in kinds.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(items, params, lora_request=lr, use_tqdm=False)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            num = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[kind].append(num / dt)
            cpu[kind].append(1000 * dc / num)
    med = statistics.median
    return {
        "base_tok_s": med(rates["base"]),
        "mixed_tok_s": med(rates["mixed"]),
        "ratio": med(m / b for m, b in zip(rates["mixed"], rates["base"], strict=True)),
        "base_cpu_ms_per_token": med(cpu["base"]),
        "mixed_cpu_ms_per_token": med(cpu["mixed"]),
        "cpu_ratio": med(cpu["base"]) / med(cpu["mixed"]),
    }


async def _ttft(prompt: list[int], lora: LoRARequest | None, rid: str, eng: Any) -> float:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    async for _ in eng.generate(rid, {"prompt_token_ids": prompt}, params, lora_request=lora):
        return time.perf_counter() - t0
    raise RuntimeError("no output")


async def _cold_ttft(eargs: Any, adapters: list[str], prompt: list[int]) -> dict[str, float]:
    """Each request has a prompt of its own (no prefix-cache hits): base, an adapter
    already loaded, adapters that are not (read from disk first)."""
    from fleetserve.engine.async_engine import AsyncEngine

    eng = AsyncEngine(eargs, 64)
    await eng.start()
    n = iter(range(1, 1000))

    def fresh() -> list[int]:
        k = next(n)
        return [(t + 7 * k) % 30000 + 3 for t in prompt]

    try:
        warm = LoRARequest("warm", 1, adapters[0])
        await _ttft(fresh(), warm, "w0", eng)  # loads "warm"
        base = [await _ttft(fresh(), None, f"b{i}", eng) for i in range(3)]
        loaded = [await _ttft(fresh(), warm, f"l{i}", eng) for i in range(3)]
        cold = []
        for i, path in enumerate(adapters[1:4]):
            lora = LoRARequest(f"cold{i}", i + 2, path)
            cold.append(await _ttft(fresh(), lora, f"c{i}", eng))
    finally:
        await eng.shutdown()
    return {
        "ttft_base_ms": 1000 * statistics.median(base),
        "ttft_loaded_adapter_ms": 1000 * statistics.median(loaded),
        "ttft_cold_adapter_ms": 1000 * statistics.median(cold),
    }


def _targets(spec: str) -> tuple[str, ...]:
    targets = TARGETS if spec == "all" else tuple(spec.split(","))
    bad = sorted(set(targets) - set(TARGETS))
    if bad:
        raise ValueError(f"--targets: unknown projections {bad}; choose from {TARGETS}")
    return targets


def run(args: argparse.Namespace) -> int:
    from fleetserve import LLM

    if args.compare:
        from fleetserve.bench.lora_peers import run_peers

        args.target_tuple = _targets(args.targets)
        return run_peers(args, write_random_adapter)

    eargs = engine_args_from(args)
    eargs = replace(
        eargs,
        enable_lora=True,
        max_loras=args.num_adapters,
        max_lora_rank=args.rank,
        max_cpu_loras=max(args.num_adapters, 8),
        max_num_seqs=max(eargs.max_num_seqs, args.streams),
    )
    config, _ = eargs.resolve()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(
            3, min(config.model.vocab_size, 10000), (args.prompt_tokens,), generator=g
        ).tolist()
        for _ in range(args.streams)
    ]
    targets = _targets(args.targets)
    with tempfile.TemporaryDirectory(prefix="fleetserve-lora-bench-") as tmp:
        adapters = [
            write_random_adapter(config.model, Path(tmp) / f"a{i}", args.rank, i, targets)
            for i in range(max(args.num_adapters, 4))
        ]
        llm = LLM(**vars(eargs))
        loras = [
            LoRARequest(
                f"a{i % args.num_adapters}",
                1 + i % args.num_adapters,
                adapters[i % args.num_adapters],
            )
            for i in range(args.streams)
        ]
        measured = _throughput(llm, prompts, loras, args.num_tokens, args.repeats)
        del llm
        figures: dict[str, Any] = {
            "streams": args.streams,
            "num_adapters": args.num_adapters,
            "rank": args.rank,
            "targets": list(targets),
            **measured,
            "load_1m": os.getloadavg()[0],
        }
        if not args.skip_ttft:
            one = replace(eargs, max_loras=1, max_cpu_loras=8)
            figures.update(asyncio.run(_cold_ttft(one, adapters, prompts[0])))
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0
