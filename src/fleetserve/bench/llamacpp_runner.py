"""The llama.cpp side of `fleetserve bench latency|perplexity --compare llamacpp` (the
fleetserve side, which starts it: bench/llamacpp.py).

Runs as a script under another interpreter (the one with llama-cpp-python installed), so
fleetserve's environment never needs it: it imports nothing from fleetserve. Reads one
JSON job from stdin, prints one JSON result line on stdout.

jobs: {"model": path, "prompt_token_ids": [...], "num_tokens": N, "threads": T,
       "repeats": R, "n_ctx": C}  (latency: greedy tokens, timed)
      {"mode": "perplexity", "model": path, "token_ids": [...], "context": C,
       "threads": T}  (perplexity over windows of C tokens, as bench/perplexity.py cuts)
"""

from __future__ import annotations

import json
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def perplexity(job: dict) -> dict:
    import math

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    ctx = job["context"]
    llm = Llama(
        model_path=job["model"],
        n_ctx=ctx + 8,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_batch=ctx + 8,
        logits_all=True,
        verbose=False,
    )
    ids = job["token_ids"]
    nll, n = 0.0, 0
    top1: list[int] = []
    for start in range(0, len(ids), ctx):
        window = ids[start : start + ctx]
        if len(window) < 2:
            continue
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(window) - 1), window[1:]].sum())
        n += len(window) - 1
        top1 += [int(t) for t in logits.argmax(axis=1)]
    return {
        "version": llama_cpp.__version__,
        "num_scored": n,
        "perplexity": math.exp(nll / n),
        "top1": top1,
    }


def main() -> int:
    job = json.load(sys.stdin)
    if job.get("mode") == "perplexity":
        print(json.dumps(perplexity(job)))
        return 0
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(
        model_path=job["model"],
        n_ctx=job["n_ctx"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_batch=512,
        verbose=False,
    )
    prompt, n = job["prompt_token_ids"], job["num_tokens"]
    runs = []
    tokens: list[int] = []
    for _ in range(job["repeats"] + 1):  # the first run warms up and is dropped
        llm.reset()
        tokens = []
        t0 = time.perf_counter()
        t_first, cpu_first = t0, time.process_time()
        # generate() never stops by itself: EOS is ignored, as the fleetserve side does.
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            if not tokens:
                t_first, cpu_first = time.perf_counter(), time.process_time()
            tokens.append(int(tok))
            if len(tokens) == n:
                break
        t_end, cpu_end = time.perf_counter(), time.process_time()
        runs.append(
            {
                "ttft_s": t_first - t0,
                "decode_s": t_end - t_first,
                "decode_cpu_s": cpu_end - cpu_first,
            }
        )
    result = {
        "version": llama_cpp.__version__,
        "runs": runs[1:],
        "token_ids": tokens,
        "rss_mib": _rss_mib(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
