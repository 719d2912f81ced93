"""`fleetserve bench perplexity`: quality of each weight quantization on a fixed text.

The text (default: bench/data/english.txt, ~600 tokens of plain English prose) is cut
into windows of ``--context`` tokens; each window's tokens are scored given the ones
before them in the window (prompt logprobs), and perplexity is exp of the mean negative
log-likelihood over every scored token. Each ``--quantizations`` entry loads the model
once more in the same process; ``bf16`` is the unquantized model with bf16 weights
(`bf16_weights`), ``none`` the same at float32. ``--compare llamacpp`` scores the same token ids with
llama-cpp-python (see `fleetserve bench latency`) and reports the teacher-forced top-1
agreement: at how many scored positions both pick the same most likely next token.
``--reference hf`` scores the same windows with HF transformers in float32 and reports
each run's (and llama.cpp's) top-1 agreement with it (bench/perplexity_hf.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from fleetserve.bench.llamacpp import add_llamacpp_args, require_gguf, run_job
from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from

DEFAULT_TEXT = Path(__file__).with_name("data") / "english.txt"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file to score")
    p.add_argument("--context", type=int, default=512, help="tokens per scored window")
    p.add_argument(
        "--quantizations",
        default=None,
        help="comma-separated (none,gguf,int8,bf16); default: gguf,none,int8 for a .gguf "
        "model, none,int8 otherwise",
    )
    add_llamacpp_args(p)
    p.add_argument(
        "--reference",
        choices=["hf"],
        default=None,
        help="also score with HF transformers (float32) and report top-1 agreement with it",
    )
    p.add_argument("--json", default=None, help="write the figures here")


def _windows(ids: list[int], context: int) -> list[list[int]]:
    return [ids[i : i + context] for i in range(0, len(ids), context) if len(ids[i:]) > 1]


def score(args: argparse.Namespace, quantization: str, text: str) -> dict[str, Any]:
    from fleetserve import LLM, SamplingParams

    bf16 = quantization == "bf16"  # each kind names its weights: none is float32
    ea = dataclasses.replace(
        engine_args_from(args), quantization="none" if bf16 else quantization, bf16_weights=bf16
    )
    if ea.max_model_len is None:
        ea.max_model_len = args.context + 8
    llm = LLM(**dataclasses.asdict(ea))
    ids = llm.get_tokenizer().encode(text)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    nll, n = 0.0, 0
    top1: list[int] = []
    for window in _windows(ids, args.context):
        out = llm.generate({"prompt_token_ids": window}, params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None
        for row, tok in zip(out.prompt_logprobs[1:], window[1:], strict=True):
            assert row is not None
            nll -= row[tok]
            n += 1
            top1.append(max(row, key=row.__getitem__))
    resolved = llm.engine.config.quantization
    if llm.engine.config.bf16_weights:
        resolved += " (bf16 weights)"
    model = llm.engine.config.model_path
    llm.engine.shutdown()
    return {
        "quantization": resolved,
        "model": model,
        "token_ids": ids,
        "num_scored": n,
        "perplexity": math.exp(nll / n),
        "top1": top1,
    }


def score_llamacpp(args: argparse.Namespace, model: str, ids: list[int]) -> dict[str, Any]:
    job = {"mode": "perplexity", "model": model, "token_ids": ids, "context": args.context,
           "threads": args.num_threads or 2}  # fmt: skip
    return run_job(args.llamacpp_python, job)


def run(args: argparse.Namespace) -> int:
    if args.context < 2:
        raise ValueError("--context must be >= 2")
    text = Path(args.text).read_text(encoding="utf-8")
    if args.quantizations:
        kinds = [k.strip() for k in args.quantizations.split(",") if k.strip()]
    else:
        is_gguf = str(args.model or "").endswith(".gguf") or args.model is None
        kinds = ["gguf", "none", "int8"] if is_gguf else ["none", "int8"]
    results: dict[str, Any] = {"text": args.text, "context": args.context, "runs": []}
    top1s: dict[str, list[int]] = {}
    for kind in kinds:
        r = score(args, kind, text)
        top1s[kind] = r["top1"]
        results["runs"].append({k: v for k, v in r.items() if k not in ("token_ids", "top1")})
        line = f"{kind:>5}: perplexity {r['perplexity']:.4f} over {r['num_scored']} tokens"
        if kind != kinds[0]:  # teacher-forced top-1 agreement with the first kind
            agree = sum(a == b for a, b in zip(r["top1"], top1s[kinds[0]], strict=True))
            results["runs"][-1][f"top1_agreement_with_{kinds[0]}"] = agree / len(r["top1"])
            line += f"; top-1 agreement with {kinds[0]}: {100 * agree / len(r['top1']):.2f}%"
        print(line)
    if args.compare == "llamacpp":
        model = results["runs"][0]["model"]
        require_gguf(model)
        lc = score_llamacpp(args, model, r["token_ids"])
        ours, theirs = r["top1"], lc.pop("top1")
        agree = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)
        lc["top1_agreement"] = agree
        results["llamacpp"] = lc
        top1s["llamacpp"] = theirs
        print(f"llama.cpp {lc['version']}: perplexity {lc['perplexity']:.4f} over "
              f"{lc['num_scored']} tokens; top-1 agreement with {kinds[-1]}: "
              f"{100 * agree:.1f}%")  # fmt: skip
    if args.reference == "hf":
        _compare_with_hf(args, results, r, top1s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _compare_with_hf(
    args: argparse.Namespace, results: dict[str, Any], last: dict[str, Any],
    top1s: dict[str, list[int]],
) -> None:  # fmt: skip
    from fleetserve.bench.perplexity_hf import agreement, score_hf

    ref = score_hf(last["model"], _windows(last["token_ids"], args.context), args.num_threads)
    agree = {name: agreement(top1, ref["top1"]) for name, top1 in top1s.items()}
    results["hf"] = {"perplexity": ref["perplexity"], "num_scored": ref["num_scored"],
                     "top1_agreement": agree}  # fmt: skip
    print(f"HF transformers (float32): perplexity {ref['perplexity']:.4f}; top-1 agreement "
          + ", ".join(f"{name} {100 * a:.2f}%" for name, a in agree.items()))  # fmt: skip
