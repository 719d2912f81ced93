"""The llama.cpp side of `fleetserve bench latency --compare llamacpp`.

Runs as a script under another interpreter (the one with llama-cpp-python installed), so
fleetserve's environment never needs it: it imports nothing from fleetserve. Reads one
JSON job from stdin, prints one JSON result line on stdout.

job: {"model": path, "prompt_token_ids": [...], "num_tokens": N, "threads": T,
      "repeats": R, "n_ctx": C}
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


def main() -> int:
    job = json.load(sys.stdin)
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
        t_first = t0
        # generate() never stops by itself: EOS is ignored, as the fleetserve side does.
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            if not tokens:
                t_first = time.perf_counter()
            tokens.append(int(tok))
            if len(tokens) == n:
                break
        t_end = time.perf_counter()
        runs.append({"ttft_s": t_first - t0, "decode_s": t_end - t_first})
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
