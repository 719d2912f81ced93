"""`fleetserve bench offline`: throughput of one LLM.generate over a seeded workload.

With ``--compare hf`` the same workload runs through HF transformers ``generate`` in the
same process right after (batches of 16, left padding), and the ratio is printed along
with how many requests produced identical greedy tokens. ``--compare vllm`` does the same
with vLLM's CPU build in its own interpreter, at vLLM's default dtype unless
``--vllm-dtype`` forces one (bench/offline_vllm.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

from fleetserve.bench.offline_vllm import add_vllm_args, check_vllm_args, run_vllm_offline
from fleetserve.bench.workloads import (
    BenchRequest,
    default_workload,
    load_workload,
    shared_prefix_workload,
)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the bench Llama, made once)")
    p.add_argument(
        "--workload",
        default="default",
        help="default | shared-prefix | PATH.json (shaped like shared/bench/workload.json)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", choices=["hf", "vllm"], default=None)
    p.add_argument("--hf-batch-size", type=int, default=16)
    add_vllm_args(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="fleetserve's KV cache (auto: the compute dtype, bf16 with bf16 weights)",
    )  # fmt: skip
    p.add_argument("--num-threads", type=int, default=2, help="in all (split among TP x PP ranks)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--quantization", default=None, choices=["none", "gguf", "int8"], help="weights")
    p.add_argument(
        "--bf16-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="linear layers in bf16 (default: as --dtype auto picks)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="fleetserve's compute dtype (auto: what this CPU runs fastest, said at start-up)",
    )
    p.add_argument("--json", default=None, help="write the figures here")


def bench_model_path() -> str:
    """The bench Llama (random weights), written once into the cache folder."""
    from fleetserve.models.make_model import make_model

    root = os.environ.get("FLEETSERVE_CACHE", os.path.expanduser("~/.cache/fleetserve"))
    path = os.path.join(root, "models", "bench-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"writing the bench model to {path} ...", flush=True)
        make_model(path, arch="llama", size="bench", seed=0)
    return path


def _max_model_len(args: argparse.Namespace, reqs: list[BenchRequest]) -> int:
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    return int(args.max_model_len or longest + 16)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_fleetserve(
    model: str, reqs: list[BenchRequest], args: argparse.Namespace, prefix_caching: bool
) -> dict[str, Any]:
    import torch

    from fleetserve import LLM, SamplingParams

    torch.set_num_threads(args.num_threads)
    max_len = _max_model_len(args, reqs)
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=prefix_caching,
        num_threads=args.num_threads,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        quantization=args.quantization,
        bf16_weights=args.bf16_weights,
        dtype=args.dtype,
    )
    startup = time.perf_counter() - t0
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    # Warm-up, not timed (first-call allocations), then drop its cache entries.
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.core.block_manager.reset_prefix_cache()
    bm = llm.engine.core.block_manager
    q0, h0 = bm.num_queried_tokens, bm.num_hit_tokens
    executor = llm.engine.core.executor
    parallel = hasattr(executor, "collect_stats")  # MultiprocExecutor (TP or PP > 1)
    if parallel:
        executor.collect_stats(reset=True)
    steps0 = llm.engine.core.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    if parallel:
        # Summed over ranks: each holds its own KV heads of its own layers.
        cfg = llm.engine.config
        kv_bytes = bm.num_blocks * bm.block_size * cfg.model.kv_bytes_per_token_in(cfg.kv_dtype)
        rank_stats = executor.collect_stats()
    else:
        kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in executor.runner.kv_caches)
    queried = bm.num_queried_tokens - q0
    result = _figures("fleetserve", reqs, wall, [o.outputs[0].token_ids for o in outs])
    result.update(
        startup_s=startup,
        prefix_caching=prefix_caching,
        prefix_cache_hit_rate=(bm.num_hit_tokens - h0) / queried if queried else 0.0,
        num_preemptions=llm.engine.core.scheduler.num_preemptions,
        kv_cache_mib=kv_bytes / 2**20,
        peak_rss_mib=_peak_rss_mib(),
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        num_engine_steps=llm.engine.core.num_steps - steps0,
        quantization=llm.engine.config.quantization,
        dtype=str(llm.engine.config.model.dtype).removeprefix("torch."),
        bf16_weights=llm.engine.config.bf16_weights,
    )
    if parallel:
        result["ranks"] = rank_stats
        _print_ranks(rank_stats)
    llm.engine.shutdown()
    return result


def _print_ranks(ranks: list[dict[str, Any]]) -> None:
    """Per-rank busy time and host-side communication time per worker step."""
    for r in ranks:
        n = max(r["num_steps"], 1)
        print(
            f"  rank {r['rank']}: {r['num_steps']} steps, busy {r['busy_s']:.2f} s of "
            f"{r['window_s']:.2f} s (idle {r['idle_fraction']:.0%}); per step: all-reduce "
            f"{1e3 * r['all_reduce_s'] / n:.2f} ms ({r['num_all_reduces'] / n:.0f} calls), "
            f"logit all-gather {1e3 * r['all_gather_s'] / n:.2f} ms, send "
            f"{1e3 * r['send_s'] / n:.2f} ms, recv wait {1e3 * r['recv_s'] / n:.2f} ms",
            flush=True,
        )


def run_hf(model: str, reqs: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos
    hf.generation_config.pad_token_id = 0
    startup = time.perf_counter() - t0
    outputs: list[list[int]] = []
    bsz = args.hf_batch_size
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), bsz):
            batch = reqs[i : i + bsz]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, r in enumerate(batch):  # left padding
                n = len(r.prompt_token_ids)
                ids[j, width - n :] = torch.tensor(r.prompt_token_ids)
                mask[j, width - n :] = 1
            new = max(r.output_len for r in batch)
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
            for j, r in enumerate(batch):
                outputs.append(out[j, width : width + r.output_len].tolist())
            print(f"  hf batch {i // bsz + 1}/{-(-len(reqs) // bsz)} done", flush=True)
    wall = time.perf_counter() - t0
    result = _figures("hf-transformers", reqs, wall, outputs)
    result.update(startup_s=startup, peak_rss_mib=_peak_rss_mib())
    return result


def _figures(
    engine: str, reqs: list[BenchRequest], wall: float, outputs: list[list[int]]
) -> dict[str, Any]:
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(len(o) for o in outputs)
    return {
        "engine": engine,
        "num_requests": len(reqs),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "wall_s": wall,
        "requests_per_s": len(reqs) / wall,
        "output_tok_per_s": n_out / wall,
        "total_tok_per_s": (n_in + n_out) / wall,
        "outputs": outputs,
    }


def _memory(r: dict[str, Any]) -> str:
    """fleetserve's peak RSS (one process); a peer's RSS after its run, its engine's
    processes included (vLLM's engine core is a child process, whose peak the runner
    cannot read)."""
    if "peak_rss_mib" in r:
        return f"peak RSS {r['peak_rss_mib']:.0f} MiB"
    if "rss_after_mib" in r:
        return f"RSS after the run {r['rss_after_mib']:.0f} MiB (with its engine processes)"
    return "RSS not measured"


def _print(r: dict[str, Any]) -> None:
    print(
        f"{r['engine']:>16}: {r['wall_s']:7.1f} s  {r['requests_per_s']:6.2f} req/s  "
        f"{r['output_tok_per_s']:7.1f} out tok/s  {r['total_tok_per_s']:7.1f} total tok/s  "
        f"start-up {r.get('startup_s', 0):.1f} s  {_memory(r)}"
        + (f" (KV cache {r['kv_cache_mib']:.0f} MiB)" if "kv_cache_mib" in r else ""),
        flush=True,
    )


def _against(
    ours: dict[str, Any], peer: dict[str, Any], results: dict[str, Any], label: str
) -> tuple[float, int]:
    """A peer's run printed and kept in `results`; our output tok/s over its, and how many
    greedy outputs are the same (both printed)."""
    _print(peer)
    results["runs"].append(peer)
    same = sum(a == b for a, b in zip(ours["outputs"], peer["outputs"], strict=True))
    ratio = ours["output_tok_per_s"] / peer["output_tok_per_s"]
    print(
        f"fleetserve / {label} output tok/s: {ratio:.2f}x; identical greedy outputs: "
        f"{same}/{len(ours['outputs'])}",
        flush=True,
    )
    return ratio, same


def _compare_vllm(
    model: str,
    reqs: list[BenchRequest],
    args: argparse.Namespace,
    ours: dict[str, Any],
    results: dict[str, Any],
) -> None:
    res = run_vllm_offline(model, reqs, args, _max_model_len(args, reqs))
    peer = _figures(f"vllm {res['version']} {res['dtype']}", reqs, res["wall_s"], res["outputs"])
    peer.update(startup_s=res["startup_s"], dtype=res["dtype"])
    if "rss_after_mib" in res:
        peer["rss_after_mib"] = res["rss_after_mib"]
    ratio, same = _against(ours, peer, results, f"vLLM ({res['dtype']})")
    results["speedup_vs_vllm"] = ratio
    results["identical_greedy_outputs_vllm"] = same


def run(args: argparse.Namespace) -> int:
    check_vllm_args(args)
    model = args.model or bench_model_path()
    if args.workload == "default":
        reqs = default_workload(args.num_prompts, args.seed)
    elif args.workload == "shared-prefix":
        reqs = shared_prefix_workload(args.num_prompts, args.seed)
    else:
        reqs = load_workload(args.workload)[: args.num_prompts]
    print(
        f"workload {args.workload}: {len(reqs)} requests, "
        f"{sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
        f"{sum(r.output_len for r in reqs)} output tokens; model {model}",
        flush=True,
    )
    results: dict[str, Any] = {"workload": args.workload, "model": model, "runs": []}
    ours = run_fleetserve(model, reqs, args, args.prefix_caching)
    _print(ours)
    results["runs"].append(ours)
    if args.workload == "shared-prefix":
        print(f"prefix-cache hit rate: {ours['prefix_cache_hit_rate']:.1%}", flush=True)
        off = run_fleetserve(model, reqs, args, prefix_caching=False)
        off["engine"] = "fleetserve (no prefix cache)"
        _print(off)
        results["runs"].append(off)
        speedup = off["wall_s"] / ours["wall_s"]
        results["prefix_caching_speedup"] = speedup
        print(f"prefix caching speedup: {speedup:.2f}x", flush=True)
    if args.compare == "hf":
        ratio, same = _against(ours, run_hf(model, reqs, args), results, "HF")
        results["speedup_vs_hf"] = ratio
        results["identical_greedy_outputs"] = same
    if args.compare == "vllm":
        _compare_vllm(model, reqs, args, ours, results)
    if args.json:
        for r in results["runs"]:
            r.pop("outputs", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
