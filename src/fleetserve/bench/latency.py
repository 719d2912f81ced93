"""`fleetserve bench latency`: what one chat user feels, one stream at a time.

A fixed short chat prompt (~25 tokens on SmolLM2), N greedy tokens with EOS ignored:
time to first token (prefill + first sample) and decode tokens per second after it,
the median of ``--repeats`` runs after one warm-up. Every engine flag passes through
(``--quantization``, ``--num-threads``, ...); ``--max-num-seqs`` defaults to 1 here, so
the KV cache is sized for the one stream.

``--compare llamacpp`` runs two peers on the same GGUF file and thread count in the same
invocation: llama.cpp's own C++ ``llama-bench`` (tg N and pp ``--pp-tokens``, binary given
by ``--llama-bench``; bench/llama_bench.py), for which fleetserve also times a prefill of
``--pp-tokens`` random token ids; then llama-cpp-python on the same prompt token ids, under
the interpreter given by ``--llamacpp-python`` (a separate environment: fleetserve depends
on neither), with how many greedy tokens the two agree on before they part.

``--roofline`` runs bench/roofline.py's read probe (1 and 2 threads; a buffer the size of
the bytes a decode token reads, and one beyond the L3) in the same process right after
the decode runs, and prints decode tok/s x MB/token against it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import asdict
from typing import Any

from fleetserve.bench.llama_bench import (
    add_llama_bench_args,
    find_llama_bench,
    llama_bench_command,
    run_llama_bench,
)
from fleetserve.bench.llamacpp import add_llamacpp_args, peer_env, require_gguf, run_job
from fleetserve.bench.roofline import (
    DEFAULT_SET_MB,
    bytes_per_token,
    default_dram_mb,
    format_probes,
    probe_all,
    roofline_lines,
)
from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from

SYSTEM = "You are a storyteller."
USER = "Tell me a story about a robot."


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    # One stream: a KV cache sized for one sequence, not the engine's default 64.
    p.set_defaults(max_num_seqs=1)
    p.add_argument("--num-tokens", type=int, default=256, help="greedy tokens per run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    add_llamacpp_args(p)
    add_llama_bench_args(p)
    p.add_argument(
        "--llamacpp-threads", type=int, default=None, help="default: --num-threads, else 2"
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="probe the read bandwidth of 1 and 2 threads (bench roofline) right after the "
        "decode runs and print decode tok/s x bytes/token against it",
    )
    p.add_argument("--json", default=None, help="write the figures here")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _summary(runs: list[dict[str, float]], num_tokens: int) -> dict[str, float]:
    ttft = statistics.median(r["ttft_s"] for r in runs)
    decode = statistics.median(r["decode_s"] for r in runs)
    cpu = statistics.median(r["decode_cpu_s"] for r in runs)
    return {
        "ttft_ms": 1000 * ttft,
        # The first token comes with the prefill: the rest are the decode.
        "decode_tok_s": (num_tokens - 1) / decode if decode > 0 else float("inf"),
        # CPU time of every thread of the process per decoded token: on a shared machine
        # it moves less with the load than the wall clock does.
        "decode_cpu_ms_per_token": 1000 * cpu / (num_tokens - 1),
    }


def run_fleetserve(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fleetserve.core.sampling_params import SamplingParams
    from fleetserve.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args)
    if engine_args.max_model_len is None:
        engine_args.max_model_len = max(64 + args.num_tokens, 16 + args.pp_tokens)
    if engine_args.num_threads is not None:
        torch.set_num_threads(engine_args.num_threads)
    engine = LLMEngine(engine_args)
    rss = _rss_mib()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    if engine.tokenizer.has_chat_template:
        ids = engine.tokenizer.apply_chat_template(messages)
    else:  # a base model (Gemma 3 270M): the same words as plain text
        ids = engine.tokenizer.encode(f"{SYSTEM}\n\n{USER}\n")
    params = SamplingParams(max_tokens=args.num_tokens, temperature=0.0, ignore_eos=True)
    runs: list[dict[str, float]] = []
    tokens: list[int] = []
    for i in range(args.repeats + 1):  # the first run warms up and is dropped
        t0 = time.perf_counter()
        t_first, cpu_first = None, 0.0
        engine.add_request(f"latency-{i}", {"prompt_token_ids": ids}, params)
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():  # deltas: this step's new tokens
                for c in out.outputs:
                    if t_first is None and c.token_ids:
                        t_first, cpu_first = time.perf_counter(), time.process_time()
                    tokens.extend(c.token_ids)
        t_end, cpu_end = time.perf_counter(), time.process_time()
        assert t_first is not None and len(tokens) == args.num_tokens
        runs.append(
            {
                "ttft_s": t_first - t0,
                "decode_s": t_end - t_first,
                "decode_cpu_s": cpu_end - cpu_first,
            }
        )
    config = engine.config
    # Bytes a decode token reads at the runs' mean context (weights, head, KV).
    token_bytes = bytes_per_token(engine, len(ids) + args.num_tokens / 2)
    pp = _time_prefill(engine, args) if args.compare == "llamacpp" else None
    engine.shutdown()
    return {
        "engine": "fleetserve",
        "model": config.model_path,
        "quantization": config.quantization,
        "int8_activations": config.int8_activations,
        "num_threads": torch.get_num_threads(),
        "prompt_token_ids": ids,
        "token_ids": tokens,
        "rss_after_load_mib": rss,
        "runs": runs[1:],
        **_summary(runs[1:], args.num_tokens),
        **({"pp_tok_s": pp} if pp is not None else {}),
        **({"mb_per_token": token_bytes / 1e6} if token_bytes else {}),
    }


def _time_prefill(engine: Any, args: argparse.Namespace) -> float:
    """Prompt tokens/s of a --pp-tokens prefill (+ one sampled token), the median of
    --repeats runs: llama-bench's pp test on fleetserve's side. Fresh random ids each run,
    so the prefix cache never serves one."""
    from fleetserve.core.sampling_params import SamplingParams

    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(args.repeats):
        rng = random.Random(i)
        ids = [rng.randrange(4, vocab) for _ in range(args.pp_tokens)]
        t0 = time.perf_counter()
        engine.add_request(f"pp-{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return args.pp_tokens / statistics.median(times)


def run_llama_bench_row(args: argparse.Namespace, fs: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's C++ llama-bench: tg --num-tokens and pp --pp-tokens, same file and threads."""
    threads = args.llamacpp_threads or args.num_threads or 2
    cmd = llama_bench_command(
        find_llama_bench(args.llama_bench),
        fs["model"],
        threads,
        n_gen=args.num_tokens,
        n_prompt=args.pp_tokens,
        repeats=args.repeats,
    )
    print("$", " ".join(cmd), flush=True)
    r = run_llama_bench(cmd, peer_env())
    return {
        "engine": f"llama.cpp llama-bench {r.build}",
        "num_threads": r.threads,
        "decode_tok_s": r.tg_tok_s,
        "decode_tok_s_stddev": r.tg_stddev,
        "pp_tok_s": r.pp_tok_s,
        "pp_tok_s_stddev": r.pp_stddev,
    }


def run_llamacpp(args: argparse.Namespace, fs: dict[str, Any]) -> dict[str, Any]:
    model = fs["model"]
    require_gguf(model)
    threads = args.llamacpp_threads or args.num_threads or 2
    job = {
        "model": model,
        "prompt_token_ids": fs["prompt_token_ids"],
        "num_tokens": args.num_tokens,
        "threads": threads,
        "repeats": args.repeats,
        "n_ctx": 64 + args.num_tokens + len(fs["prompt_token_ids"]),
    }
    res = run_job(args.llamacpp_python, job)
    return {
        "engine": f"llama-cpp-python {res['version']}",
        "num_threads": threads,
        "token_ids": res["token_ids"],
        "rss_after_run_mib": res["rss_mib"],
        "runs": res["runs"],
        **_summary(res["runs"], args.num_tokens),
    }


def _roofline(args: argparse.Namespace, fs: dict[str, Any], results: dict[str, Any]) -> None:
    """The read probe in this process, right after the decode runs: the working-set size
    (this token's bytes) and beyond the L3, 1 and 2 threads."""
    token_mb = fs.get("mb_per_token")
    probes = probe_all([1, 2], token_mb or DEFAULT_SET_MB, default_dram_mb(), 10)
    print(format_probes(probes))
    results["read_probes"] = [asdict(p) for p in probes]
    if token_mb:
        print(
            roofline_lines(
                fs["decode_tok_s"],
                fs["decode_cpu_ms_per_token"],
                token_mb,
                fs["num_threads"],
                probes,
            )  # fmt: skip
        )


def _agree(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy runs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(args: argparse.Namespace) -> int:
    if args.num_tokens < 2 or args.repeats < 1 or args.pp_tokens < 1:
        raise ValueError("--num-tokens must be >= 2, --repeats >= 1 and --pp-tokens >= 1")
    if args.compare == "llamacpp":  # refuse before the fleetserve run, not after it
        if args.model:
            require_gguf(args.model)
        find_llama_bench(args.llama_bench)
    load = os.getloadavg()[0]
    fs = run_fleetserve(args)
    results: dict[str, Any] = {"load_avg_1m": load, "num_tokens": args.num_tokens}
    results["fleetserve"] = fs
    print(
        f"fleetserve ({fs['quantization']}{', int8 activations' if fs['int8_activations'] else ''}, "
        f"{fs['num_threads']} threads): prompt "
        f"{len(fs['prompt_token_ids'])} tokens, TTFT {fs['ttft_ms']:.1f} ms, decode "
        f"{fs['decode_tok_s']:.1f} tok/s over {args.num_tokens} tokens "
        f"({fs['decode_cpu_ms_per_token']:.2f} CPU ms/token), "
        f"RSS after load {fs['rss_after_load_mib']:.0f} MiB"
    )
    if args.roofline:
        _roofline(args, fs, results)
    if args.compare == "llamacpp":
        require_gguf(fs["model"])
        print(f"fleetserve prompt processing: pp{args.pp_tokens} {fs['pp_tok_s']:.1f} tok/s")
        cpp = run_llama_bench_row(args, fs)
        results["llama_bench"] = cpp
        results["decode_speedup_vs_llama_bench"] = fs["decode_tok_s"] / cpp["decode_tok_s"]
        results["pp_speedup_vs_llama_bench"] = fs["pp_tok_s"] / cpp["pp_tok_s"]
        print(
            f"{cpp['engine']} ({cpp['num_threads']} threads): tg{args.num_tokens} "
            f"{cpp['decode_tok_s']:.1f} +- {cpp['decode_tok_s_stddev']:.1f} tok/s, "
            f"pp{args.pp_tokens} {cpp['pp_tok_s']:.1f} +- {cpp['pp_tok_s_stddev']:.1f} tok/s"
        )
        print(
            f"fleetserve / llama-bench: decode {results['decode_speedup_vs_llama_bench']:.2f}x, "
            f"prompt processing {results['pp_speedup_vs_llama_bench']:.2f}x"
        )
        try:
            lc: dict[str, Any] | None = run_llamacpp(args, fs)
        except ValueError as e:  # the second row: its failure keeps the figures above
            lc = None
            results["llamacpp_error"] = str(e)
            print(f"llama-cpp-python row left out: {e}")
        if lc is not None:
            results["llamacpp"] = lc
            agree = _agree(fs["token_ids"], lc["token_ids"])
            results["decode_speedup"] = fs["decode_tok_s"] / lc["decode_tok_s"]
            results["greedy_tokens_agreed"] = agree
            print(
                f"{lc['engine']} ({lc['num_threads']} threads): TTFT {lc['ttft_ms']:.1f} ms, "
                f"decode {lc['decode_tok_s']:.1f} tok/s "
                f"({lc['decode_cpu_ms_per_token']:.2f} CPU ms/token), "
                f"RSS {lc['rss_after_run_mib']:.0f} MiB"
            )
            print(
                f"fleetserve / llama.cpp decode: {results['decode_speedup']:.2f}x; greedy "
                f"tokens identical for the first {agree} of {args.num_tokens}"
            )
    print(f"(1-minute load average at start: {load:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
