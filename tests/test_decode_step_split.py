"""Steps split by sequences over the threads (kernels/decode_step.c, split_step): each
thread runs its own sequences as a team of one. A row's results must not depend on the
split: captured steps of a bf16 model replayed split and as one team, on 2 and 3
threads, give equal hidden states, logits and argmax; whole runs give the module path's
tokens; plans whose weights depend on the call's rows refuse to split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import native

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or not native(), reason="no C compiler or no native bf16 here"
)


def _plan(llm: LLM) -> Any:
    return llm.engine.core.executor.runner.model.model.decode_plan  # type: ignore[attr-defined]


def _prompts(n: int, seed: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(3, 400, (int(5 + 7 * i % 23),), generator=g).tolist()}
        for i in range(n)
    ]


def _captured(llm: LLM, n: int, max_tokens: int) -> list[tuple[Any, ...]]:
    """The arguments of every C step of n greedy requests."""
    plan = _plan(llm)
    seen: list[tuple[Any, ...]] = []
    run = plan.run

    def capture(*args: Any) -> torch.Tensor:
        seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return run(*args)

    plan.run = capture
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate(_prompts(n, 1), params, use_tqdm=False)
    finally:
        del plan.run
    return seen


def _replay(plan: Any, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    # Every row's hidden states (sampled_only off): with it on, rows outside the sampled
    # ones are left unwritten (tests/test_sampled_rows_only.py checks that case).
    args = (*args[:13], False)
    out = plan.run(*args)
    return (out, *(a for a in args[10:] if isinstance(a, torch.Tensor)))


@pytest.fixture(scope="module")
def bf16_llm(tiny_model_factory: Callable[..., str]) -> LLM:
    return LLM(
        tiny_model_factory("llama"), bf16_weights=True, max_model_len=128, block_size=4,
        num_kv_blocks=640, max_num_batched_tokens=48, max_num_seqs=24,
    )  # fmt: skip


def _dot_llm(tiny_model_factory: Callable[..., str]) -> LLM:
    """Int8 weights in the dot layout (int8 activations)."""
    return LLM(
        tiny_model_factory("llama"), quantization="int8", int8_activations=True,
        max_model_len=128, block_size=4, num_kv_blocks=640, max_num_batched_tokens=48,
        max_num_seqs=24,
    )  # fmt: skip


@pytest.mark.parametrize("weights", ["bf16", "int8 dot layout"])
def test_split_steps_give_the_team_bits(
    weights: str,
    bf16_llm: LLM,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = bf16_llm if weights == "bf16" else _dot_llm(tiny_model_factory)
    plan = _plan(llm)
    # On by default, from fewer rows where a weight takes fewer bytes.
    assert plan.split_min_rows == 24 if weights == "bf16" else 2 <= plan.split_min_rows < 24
    steps = _captured(llm, 24, 10)
    kinds = {bool((a[5] == 1).all()) for a in steps}
    assert kinds == {True, False}  # decode steps and steps with prompt rows
    default = plan.split_min_rows
    try:
        for threads in (2, 3):
            monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
            plan.split_min_rows = 0
            team = [_replay(plan, a) for a in steps]
            plan.split_min_rows = 1
            split, did = [], set()
            for a in steps:
                before = plan.split_steps
                split.append(_replay(plan, a))
                if plan.split_steps > before:
                    did.add(bool((a[5] == 1).all()))
            # Decode steps and steps with prompt rows split (not every one: a step whose
            # sequences do not share out evenly runs as a team).
            assert did == {True, False} or threads > 2
            for t, s in zip(team, split, strict=True):
                for a, b in zip(t, s, strict=True):
                    assert torch.equal(a, b)
    finally:
        plan.split_min_rows = default


def test_split_run_gives_the_module_path_tokens(
    bf16_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(bf16_llm)
    default = plan.split_min_rows
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    prompts = _prompts(20, 2)
    try:
        plan.split_min_rows = 1
        before = plan.split_steps
        split = bf16_llm.generate(prompts, params, use_tqdm=False)
        assert plan.split_steps > before
    finally:
        plan.split_min_rows = default
    bf16_llm.engine.core.block_manager.reset_prefix_cache()
    runner = bf16_llm.engine.core.executor.runner  # type: ignore[attr-defined]
    monkeypatch.setattr(runner.model.model, "decode_plan", None)
    module = bf16_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(split, module, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert x.keys() == y.keys()
            for tok in x:
                assert abs(x[tok] - y[tok]) < 1e-5


def test_plans_of_row_dependent_weights_do_not_split(
    tiny_model_factory: Callable[..., str],
) -> None:
    # int8 weights with float32 activations: decode and prefill kernels differ by rows.
    llm = LLM(tiny_model_factory("llama"), quantization="int8", max_model_len=64)
    plan = _plan(llm)
    assert plan.split_min_rows == 0
    with pytest.raises(ValueError, match="split_min_rows"):
        plan.split_min_rows = 16
    with pytest.raises(ValueError, match="split_min_rows"):
        _plan(LLM(tiny_model_factory("llama"), bf16_weights=True)).split_min_rows = -1


def test_environment_switch_turns_split_steps_off(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETSERVE_SPLIT_STEPS", "0")
    llm = LLM(tiny_model_factory("llama"), bf16_weights=True, max_model_len=64)
    assert _plan(llm).split_min_rows == 0
