"""HF transformers as the reference of `fleetserve bench perplexity --reference hf`: the
same token ids scored in the same windows by `AutoModelForCausalLM` in float32 (a GGUF is
dequantized by transformers' own GGUF reader), so each engine's teacher-forced top-1 can
be compared with what the weights compute, not only with another engine."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def score_hf(model: str, windows: list[list[int]], num_threads: int | None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        kwargs: dict[str, Any] = {"gguf_file": path.name}
        folder = str(path.parent)
    else:
        kwargs, folder = {}, model
    if num_threads:
        torch.set_num_threads(num_threads)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()
    nll, n = 0.0, 0
    top1: list[int] = []
    with torch.no_grad():
        for window in windows:
            logits = hf(torch.tensor([window])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            for pos, tok in enumerate(window[1:]):
                nll -= float(logprobs[pos, tok])
                n += 1
                top1.append(int(logprobs[pos].argmax()))
    return {"num_scored": n, "perplexity": math.exp(nll / n), "top1": top1}


def agreement(a: list[int], b: list[int]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"top-1 lists differ in length ({len(a)} vs {len(b)})")
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
