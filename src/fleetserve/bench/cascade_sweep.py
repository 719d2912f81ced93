"""`fleetserve bench cascade` (issue 23, item 4b): a two-tier cascade's threshold table.

Serves a small and a large generate model (and a `kind: cascade` over them) on one local
server, asks each tier every prompt of a mixed easy/hard set once (greedy completions, with
logprobs, the two tiers alternated), then computes what a cascade with
`escalate: {min_mean_logprob: T}` gives for each threshold T: a greedy cascade answers with
the small tier's text when its mean token logprob is >= T, else with exactly the large
tier's. Per row: share answered by the small tier, mean latency (small, plus large when
escalated), compute (generated tokens x parameters) against always-large, agreement with
always-large's answers and accuracy against the known answers. The harness is checked
live: a few prompts are sent to the served cascade and must match the table's prediction
(text and `X-Fleetserve-Tier`).

    fleetserve bench cascade --small SMALL.gguf --large LARGE.gguf \
        [--small-params 135e6] [--large-params 270e6] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from fleetserve.bench.local_server import serve_fleet_file

THRESHOLDS = (float("-inf"), -3.0, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25, -0.1, float("inf"))

FLEET = """
models:
  - name: small
    model: {small}
    engine: {{max_num_seqs: 2, max_model_len: 512}}
  - name: large
    model: {large}
    engine: {{max_num_seqs: 2, max_model_len: 512}}
  - name: answer
    kind: cascade
    tiers: [small, large]
    escalate: {{min_mean_logprob: {check}}}
"""


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str
    kind: str  # "easy" | "hard"


@dataclass(frozen=True)
class TierAnswer:
    text: str
    mean_logprob: float
    tokens: int
    latency_ms: float


@dataclass(frozen=True)
class Row:
    threshold: float
    small_share: float
    mean_latency_ms: float
    compute_vs_large: float
    agreement: float
    accuracy: float


def load_prompts(path: Path | None = None) -> list[Prompt]:
    """The shipped set (bench/data/cascade_prompts.jsonl) or a JSONL file of the same keys."""
    if path is None:
        text = resources.files("fleetserve.bench").joinpath("data/cascade_prompts.jsonl")
        lines = text.read_text().splitlines()
    else:
        lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(x for x in lines if x.strip()):
        row = json.loads(line)
        for key in ("prompt", "answer"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise ValueError(f"prompts[{i}].{key}: a non-empty string is needed")
        out.append(Prompt(row["prompt"], row["answer"], str(row.get("kind", "mixed"))))
    return out


def is_correct(text: str, answer: str) -> bool:
    """The known answer appears in the completion's first line (case-insensitive)."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return answer.lower() in first.lower()


def cascade_pick(small: TierAnswer, threshold: float) -> bool:
    """True when a `min_mean_logprob: threshold` cascade accepts the small tier's answer
    (the rule escalates when the mean logprob is below the floor)."""
    return small.mean_logprob >= threshold


def sweep(
    prompts: list[Prompt],
    small: list[TierAnswer],
    large: list[TierAnswer],
    small_params: float,
    large_params: float,
    thresholds: tuple[float, ...] = THRESHOLDS,
) -> list[Row]:
    """One row per threshold, from one greedy answer of each tier per prompt."""
    if not (len(prompts) == len(small) == len(large)) or not prompts:
        raise ValueError("prompts, small and large must be non-empty and of one length")
    large_compute = sum(a.tokens for a in large) * large_params
    rows = []
    for t in thresholds:
        kept = [cascade_pick(s, t) for s in small]
        texts = [s.text if k else g.text for s, g, k in zip(small, large, kept, strict=True)]
        lat = [
            s.latency_ms + (0.0 if k else g.latency_ms)
            for s, g, k in zip(small, large, kept, strict=True)
        ]
        compute = sum(
            s.tokens * small_params + (0 if k else g.tokens * large_params)
            for s, g, k in zip(small, large, kept, strict=True)
        )
        n = len(prompts)
        rows.append(
            Row(
                threshold=t,
                small_share=sum(kept) / n,
                mean_latency_ms=statistics.fmean(lat),
                compute_vs_large=compute / large_compute if large_compute else float("nan"),
                agreement=sum(x == g.text for x, g in zip(texts, large, strict=True)) / n,
                accuracy=sum(is_correct(x, p.answer) for x, p in zip(texts, prompts, strict=True))
                / n,
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    head = (
        "| min_mean_logprob | small share | mean latency ms | compute vs always-large "
        "| agreement with large | accuracy |\n|---|---|---|---|---|---|"
    )
    body = [
        f"| {r.threshold:g} | {r.small_share:.0%} | {r.mean_latency_ms:.1f} "
        f"| {r.compute_vs_large:.2f} | {r.agreement:.0%} | {r.accuracy:.0%} |"
        for r in rows
    ]
    return "\n".join([head, *body])


def ask(c: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[TierAnswer, str]:
    """One greedy completion with logprobs; the answer and the tier header (if any)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1}  # fmt: skip
    start = time.perf_counter()
    r = c.post("/v1/completions", json=body)
    ms = (time.perf_counter() - start) * 1e3
    r.raise_for_status()
    out: Any = r.json()
    choice = out["choices"][0]
    lps = [x for x in ((choice.get("logprobs") or {}).get("token_logprobs") or []) if x is not None]
    mean = statistics.fmean(lps) if lps else float("-inf")
    tokens = int(out["usage"]["completion_tokens"])
    return TierAnswer(choice["text"], mean, tokens, ms), r.headers.get("x-fleetserve-tier", "")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small", required=True, help="the small tier (HF folder or GGUF)")
    p.add_argument("--large", required=True, help="the large tier (HF folder or GGUF)")
    p.add_argument("--small-params", type=float, default=135e6)
    p.add_argument("--large-params", type=float, default=270e6)
    p.add_argument("--prompts", type=Path, default=None, help="JSONL (default: shipped set)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--check", type=float, default=-1.0, help="the live cascade's threshold")
    p.add_argument("--check-prompts", type=int, default=4)


def run(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts)
    prompts = prompts[: args.limit] if args.limit else prompts
    fleet = FLEET.format(small=args.small, large=args.large, check=args.check)
    server = serve_fleet_file(fleet, "cascade-bench")
    try:
        small: list[TierAnswer] = []
        large: list[TierAnswer] = []
        with httpx.Client(base_url=server.url, timeout=300) as c:
            ask(c, "small", prompts[0].prompt, args.max_tokens)  # warm both tiers
            ask(c, "large", prompts[0].prompt, args.max_tokens)
            for i, p in enumerate(prompts):
                order = ("small", "large") if i % 2 else ("large", "small")
                got = {m: ask(c, m, p.prompt, args.max_tokens)[0] for m in order}
                small.append(got["small"])
                large.append(got["large"])
            mismatches = _check_live(c, prompts, small, large, args)
        rows = sweep(prompts, small, large, args.small_params, args.large_params)
        print(format_table(rows))
        lat = statistics.fmean(a.latency_ms for a in large)
        acc = sum(is_correct(a.text, p.answer) for a, p in zip(large, prompts, strict=True))
        print(f"always-large: mean latency {lat:.1f} ms, accuracy {acc / len(prompts):.0%}")
        print(f"prompts: {len(prompts)}; live cascade check at {args.check:g}: "
              f"{args.check_prompts - mismatches}/{args.check_prompts} as predicted")  # fmt: skip
    finally:
        server.stop()
    return 1 if mismatches else 0


def _check_live(
    c: httpx.Client,
    prompts: list[Prompt],
    small: list[TierAnswer],
    large: list[TierAnswer],
    args: argparse.Namespace,
) -> int:
    """Send the first prompts to the served cascade; count those not as the table predicts."""
    bad = 0
    for p, s, g in list(zip(prompts, small, large, strict=True))[: args.check_prompts]:
        answer, tier = ask(c, "answer", p.prompt, args.max_tokens)
        keep = cascade_pick(s, args.check)
        want = (s.text, "small") if keep else (g.text, "large")
        if (answer.text, tier) != want:
            bad += 1
            print(f"live cascade differs on {p.prompt!r}: {(answer.text, tier)} vs {want}")
    return bad
