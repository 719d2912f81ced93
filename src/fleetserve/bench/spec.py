"""`fleetserve bench spec`: one stream's decode speed with and without speculative decoding.

An input-grounded workload (the model is asked to repeat, or lightly edit, a paragraph it
is given) runs request after request, alone, through two engines built from the same
engine flags: one without drafts, one with ``--speculative-config`` (an n-gram lookup by
default), and one more per ``--also CONFIG`` (settings compared in one sitting). Runs
alternate between the engines request by request so that machine load hits all alike.
Prints TTFT, decode tok/s (tokens after the first / time after the first), the speed-up,
whether the greedy outputs are identical, and the acceptance figures. ``--batch`` runs
every workload's prompts at once instead (drafts then share each step with other
requests' rows), its rate being output tokens per second of the whole batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}

PARAGRAPHS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small "
    "brass lamp and a notebook in which he wrote the color of the sea. On calm nights he "
    "counted the passing ships and listened to the gulls settle on the rocks below. When "
    "storms came, he stayed awake until morning, polishing the great lens so that its beam "
    "would reach the fishing boats far beyond the harbor.",
    "Our village library opens at nine in the morning and closes at six in the evening. "
    "Children may borrow up to five books at a time, and adults may borrow ten. Every "
    "Saturday a volunteer reads stories aloud in the garden behind the building, and in "
    "winter the reading moves next to the fireplace in the main hall. Late returns cost "
    "nothing, but the librarian asks that damaged books be reported at the front desk.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl until the dough "
    "comes together. Knead it on a floured table for ten minutes, then cover it and let it "
    "rise in a warm place for one hour. Shape the dough into a round loaf, place it on a tray "
    "and bake it in a hot oven for thirty-five minutes, until the crust is golden and sounds "
    "hollow when tapped.",
]
WORKLOADS = {
    "repeat": "Repeat the following paragraph exactly, word for word.\n\n{p}",
    "edit": "Correct the spelling mistakes in the following paragraph and write the whole "
    "corrected paragraph.\n\n{p}",
    # Shorter, partly new text (phrases of the paragraph come back).
    "summary": "Summarize the following paragraph in two sentences.\n\n{p}",
    # New text, no paragraph to copy from (one topic per paragraph): the bad case for
    # drafts, where only the output's own repeats give n-gram matches.
    "free": "Write a short story about {topic}.",
}
FREE_TOPICS = [
    "a robot who learns to paint",
    "a city at the bottom of the sea",
    "a dog who runs a bakery",
]


def with_typos(paragraph: str, every: int = 9) -> str:
    """A light edit to ask for: every `every`-th word of 5+ letters gets two letters swapped."""
    words = paragraph.split(" ")
    for i in range(every - 1, len(words), every):
        w = words[i]
        if len(w) >= 5 and w.isalpha():
            words[i] = w[:2] + w[3] + w[2] + w[4:]
    return " ".join(words)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="repeat")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="passes over the paragraphs")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument(
        "--batch",
        action="store_true",
        help="run every workload's prompts at once (a batch of 12) instead of one request "
        "at a time; the rate is then output tokens per second of the whole batch",
    )
    p.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="JSON",
        help="another speculative config to run in the same sitting (repeatable): every "
        "engine takes its turn on each request, so machine load hits them alike",
    )


def _prompts(llm: Any, workload: str) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": WORKLOADS[workload].format(p=p, topic=topic)}], True
        )
        for p, topic in zip(
            PARAGRAPHS if workload != "edit" else [with_typos(p) for p in PARAGRAPHS],
            FREE_TOPICS,
            strict=True,
        )
    ]


@dataclasses.dataclass
class _Tally:
    """One engine's measurements over the runs: token ids and TTFT per request, decode
    seconds per run (wall), decoded tokens and process CPU seconds in all."""

    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    ttfts: list[float] = dataclasses.field(default_factory=list)
    decode_s: list[float] = dataclasses.field(default_factory=list)
    num_decoded: int = 0
    cpu_s: float = 0.0


def _run(llm: Any, prompts: list[list[int]], max_tokens: int, tally: _Tally) -> None:
    """`prompts` at once, greedy, into `tally`. One prompt: its decode time is the request's
    after its first token (TTFT apart); several: the wall time of the whole batch and every
    output token. CPU seconds are the process's for the whole run (prefill included: the
    same for every engine)."""
    from fleetserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ids = [o.outputs[0].token_ids for o in outs]
    ttfts = [o.metrics["time_to_first_token"] for o in outs]
    if len(prompts) == 1:
        tally.decode_s.append(outs[0].metrics["e2e_latency"] - ttfts[0])
        tally.num_decoded += len(ids[0]) - 1
    else:
        tally.decode_s.append(wall)
        tally.num_decoded += sum(len(i) for i in ids)
    tally.tokens.extend(ids)
    tally.ttfts.extend(ttfts)
    tally.cpu_s += cpu


def _spec_figures(llm: Any, stats0: Any) -> dict[str, float]:
    """Acceptance figures of a speculative engine since `stats0`."""
    s0, s1 = stats0.spec_decode, llm.engine.stats().spec_decode
    assert s0 is not None and s1 is not None
    drafts = s1.num_draft_tokens - s0.num_draft_tokens
    accepted = s1.num_accepted_tokens - s0.num_accepted_tokens
    verifications = s1.num_drafts - s0.num_drafts
    return {
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_length": 1 + accepted / verifications if verifications else 0.0,
        "drafts_per_verification": drafts / verifications if verifications else 0.0,
    }


def run(args: argparse.Namespace) -> int:
    from fleetserve import LLM

    engine_args = engine_args_from(args)
    spec = engine_args.speculative_config or json.dumps(DEFAULT_SPEC)
    configs = [spec, *args.also]
    engines = {"baseline": LLM(**dataclasses.asdict(
        dataclasses.replace(engine_args, speculative_config=None)))}  # fmt: skip
    names = ["speculative"] + [f"speculative {i + 2}" for i in range(len(args.also))]
    for name, cfg in zip(names, configs, strict=True):
        engines[name] = LLM(**dataclasses.asdict(
            dataclasses.replace(engine_args, speculative_config=cfg)))  # fmt: skip
    prompts = _prompts(engines["baseline"], args.workload)
    for llm in engines.values():  # warm-up: kernels built, pages faulted in
        _run(llm, prompts[:1], 8, _Tally())
    stats0 = {n: engines[n].engine.stats() for n in names}
    tallies = {name: _Tally() for name in engines}
    if args.batch:  # every workload's prompts at once; rate = output tokens / wall
        prompts = [q for w in sorted(WORKLOADS) for q in _prompts(engines["baseline"], w)]
    groups = [prompts] if args.batch else [[p] for p in prompts]
    for _ in range(args.repeats):
        for group in groups:  # every engine takes its turn on each group
            for name, llm in engines.items():
                _run(llm, group, args.max_tokens, tallies[name])
    tokens = {n: t.tokens for n, t in tallies.items()}
    ttfts = {n: t.ttfts for n, t in tallies.items()}
    cpu = {n: t.cpu_s for n, t in tallies.items()}
    rate = {n: t.num_decoded / sum(t.decode_s) for n, t in tallies.items()}
    per_config = []
    for name, cfg in zip(names, configs, strict=True):
        per_config.append({
            "speculative_config": json.loads(cfg) if isinstance(cfg, str) else cfg,
            "decode_tok_s": rate[name],
            "ttft_ms": 1000 * statistics.median(ttfts[name]),
            "speedup": rate[name] / rate["baseline"],
            # Output tokens per CPU second of the process, whole requests: at
            # --num-threads 1 the time other processes take from this one's core does not
            # count, so under load this ratio moves less than the wall-clock one (which
            # stays the figure).
            "cpu_speedup": cpu["baseline"] / cpu[name],
            "identical_outputs": tokens["baseline"] == tokens[name],
            **_spec_figures(engines[name], stats0[name]),
        })  # fmt: skip
    first = per_config[0]
    result = {
        "workload": "all, batched" if args.batch else args.workload,
        "num_requests": len(tokens["baseline"]),
        "mean_output_tokens": statistics.mean(len(t) for t in tokens["baseline"]),
        "ttft_ms": {n: 1000 * statistics.median(ttfts[n]) for n in engines},
        "decode_tok_s": rate,
        **{k: v for k, v in first.items() if k not in ("decode_tok_s", "ttft_ms")},
        "configs": per_config,
    }
    how = f"in batches of {len(prompts)} (every workload)" if args.batch else "one at a time"
    print(f"workload {result['workload']}: {result['num_requests']} requests {how}, "
          f"{result['mean_output_tokens']:.0f} output tokens on average")  # fmt: skip
    for n in engines:
        print(f"  {n:12s} TTFT {result['ttft_ms'][n]:7.1f} ms   decode {rate[n]:7.1f} tok/s")
    for i, c in enumerate(per_config):
        label = (
            "" if len(per_config) == 1 else f"[{names[i]}: {json.dumps(c['speculative_config'])}] "
        )
        print(f"  {label}speed-up {c['speedup']:.2f}x; greedy outputs identical: "
              f"{c['identical_outputs']}")  # fmt: skip
        print(f"  CPU-time speed-up {c['cpu_speedup']:.2f}x (process CPU seconds, whole "
              "requests; steadier than wall clock on a loaded machine at one thread)")  # fmt: skip
        print(f"  acceptance rate {c['acceptance_rate']:.3f}, mean accepted length "
              f"{c['mean_accepted_length']:.2f} tokens per verification, "
              f"{c['drafts_per_verification']:.2f} drafts per verification")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if all(c["identical_outputs"] for c in per_config) else 1
