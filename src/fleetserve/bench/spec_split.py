"""Where a speculative verification step's time goes, against a one-row decode step.

`python -m fleetserve.bench.spec_split [--threads T] [--k K] [--rounds N] [--model PATH]`
runs the spec bench's repeat workload (its first paragraph, greedy) through one engine
with an n-gram drafter of K drafts (default: the bundled SmolLM2 GGUF, the C step on)
and reports:

- the run's decode steps (the prefill left out): tokens per step, the drafts'
  acceptance, and per step the CPU ms
  (thread time at one thread, wall past it) in the C step (`DecodePlan.run`), in the rest
  of `ModelRunner.execute_model` (metadata, sampling, verification, drafting: the
  worker's Python) and in the rest of `LLMEngine.step` (scheduler, detokenizer);
- the attention items and weight-row chunks each thread of the run's lead steps took
  (`lead_items`, `lead_chunks`: the second thread's share);
- one captured verification step (K + 1 rows) and one captured one-row step of the same
  run, each replayed `--rounds` times in alternation with the C step timing its phases
  (DecodePlan.start_profile, each thread's CPU clock): ms per step of each phase and the
  verification's cost in one-row steps, whole and by phase.

Replaying a step rewrites the same keys and values into the same slots: no token of the
run changes (the replay happens after it). `--burst-tokens B` (default 0: step by step)
lets a step verify on in C (worker/spec_burst.py): the C ms then include the bursts'
rounds, and the figures are per scheduler step (a step's first verification and its
burst), each also per decoded token.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from fleetserve.bench.spec import PARAGRAPHS, WORKLOADS
from fleetserve.bench.step_split import StepTimer, emit, thread_clock


def _snapshot(args: tuple[Any, ...]) -> list[Any]:
    """The step's arguments, tensors cloned (the runner reuses its buffers)."""
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _replay(plan: Any, steps: dict[str, list[Any]], rounds: int, threads: int) -> dict[str, Any]:
    """Each captured step `rounds` times, alternating, with the phase profile on."""
    out: dict[str, Any] = {}
    secs: dict[str, dict[str, float]] = {name: {} for name in steps}
    for _ in range(2):  # warm-up
        for args in steps.values():
            plan.run(*args)
    for _ in range(rounds):
        for name, args in steps.items():
            plan.start_profile(threads, cpu=True)
            plan.run(*args)
            for phase, per_thread in plan.stop_profile().items():
                # The step's cost: its busiest thread (the others wait at its barriers).
                secs[name][phase] = secs[name].get(phase, 0.0) + max(per_thread)
    for name, by_phase in secs.items():
        out[name] = {p: round(1000 * s / rounds, 4) for p, s in by_phase.items()}
        out[name]["total"] = round(sum(out[name].values()), 4)
    one = out["one_row"]
    out["verify_in_one_row_steps"] = {
        p: round(v / one[p], 2) for p, v in out["verify"].items() if one.get(p)
    }
    return out


def split(
    model: str | None, threads: int, k: int, rounds: int, max_tokens: int, burst_tokens: int = 0
) -> dict[str, Any]:
    from fleetserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "burst_tokens": burst_tokens}  # fmt: skip
    llm = LLM(model, num_threads=threads, max_model_len=1024, speculative_config=spec)
    runner = llm.engine.core.executor.runner  # type: ignore[attr-defined]
    plan = runner.model.model.decode_plan
    if plan is None:
        raise ValueError("this model has no C step here (FLEETSERVE_FUSED_DECODE=0?)")
    captured: dict[str, list[Any]] = {}

    def capture(args: tuple[Any, ...]) -> None:
        rows = args[0].shape[0]
        # The last one-row step and the last full verification (one sequence, k + 1 rows).
        name = "one_row" if rows == 1 else "verify" if rows == k + 1 else None
        if name is not None:
            captured[name] = _snapshot(args)

    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": WORKLOADS["repeat"].format(p=PARAGRAPHS[0])}], True
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm-up
    engine = llm.engine
    engine.add_request("spec-split", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prefill (and its first token), left out of the figures
    stats0 = engine.stats().spec_decode
    clock = thread_clock(threads)
    burst_run = plan.spec_burst

    def timed_burst(*args: Any) -> Any:  # a burst's rounds count as C step time
        t0 = clock()
        out = burst_run(*args)
        timer.spent["c"] += clock() - t0
        return out

    plan.spec_burst = timed_burst
    items0, chunks0 = plan.lead_items, plan.lead_chunks
    try:
        with StepTimer(runner, plan, clock, capture) as timer:
            n, tokens, t0 = 0, 0, clock()
            while engine.has_unfinished_requests():
                for out in engine.step():  # deltas
                    tokens += len(out.outputs[0].token_ids)
                n += 1
            total = clock() - t0
    finally:
        del plan.spec_burst  # the method again
    stats1 = engine.stats().spec_decode
    assert stats0 is not None and stats1 is not None
    drafts = stats1.num_draft_tokens - stats0.num_draft_tokens
    accepted = stats1.num_accepted_tokens - stats0.num_accepted_tokens
    result: dict[str, Any] = {
        "threads": threads,
        "k": k,
        "burst_tokens": burst_tokens,
        "decoded_tokens": tokens,
        "decode_steps": n,
        "tokens_per_step": round(tokens / n, 3),
        "acceptance_rate": round(accepted / drafts, 3) if drafts else 0.0,
        "verifications": stats1.num_drafts - stats0.num_drafts,
        "ms_per_step": {
            ("all" if key == "step_ms" else key.removesuffix("_ms")): round(ms, 4)
            for key, ms in timer.per_step_ms(total, n).items()
        },
        "ms_per_token": {
            ("all" if key == "step_ms" else key.removesuffix("_ms")): round(ms, 4)
            for key, ms in timer.per_step_ms(total, tokens).items()
        },
    }
    # What each thread of the run's lead steps took: attention items, weight-row chunks.
    result["lead_items"] = [b - a for a, b in zip(items0, plan.lead_items, strict=True)]
    result["lead_chunks"] = [b - a for a, b in zip(chunks0, plan.lead_chunks, strict=True)]
    if set(captured) == {"one_row", "verify"}:
        result["context"] = {name: int(a[6][0]) for name, a in captured.items()}
        result["replay"] = _replay(plan, captured, rounds, threads)
    llm.engine.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=7, help="drafts per verification")
    p.add_argument("--rounds", type=int, default=200, help="replays of each captured step")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--burst-tokens", type=int, default=0,
                   help="speculative bursts of this many tokens (0: step by step)")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.k < 1 or args.k > 15:
        raise ValueError(f"--k must be in [1, 15], got {args.k}")
    if args.burst_tokens < 0:
        raise ValueError(f"--burst-tokens must be >= 0, got {args.burst_tokens}")
    out = split(args.model, args.threads, args.k, args.rounds, args.max_tokens, args.burst_tokens)
    emit(out, args.json)


if __name__ == "__main__":
    main()
