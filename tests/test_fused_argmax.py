"""Greedy sampling fused into the C step (kernels/decode_step.c): the argmax its threads
find over their spans of the head's logits must be numpy's (the sampler's `argmax_rows`):
the first maximum, the first NaN if any, ties across the spans' borders included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import rows_argmax

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 1000, generator=g)
    x[1, [10, 500, 999]] = 9.0  # ties: the first, in span 0 of several
    x[2, [499, 500]] = 9.0  # a tie across the border of 2 spans
    x[3] = float("-inf")  # all -inf: index 0
    x[4] = 0.0
    x[4, 700] = -0.0  # +0 and -0 equal: index 0
    x[5, 900] = float("nan")  # a NaN in the last span beats a larger value before it
    x[5, 3] = 50.0
    x[6, [800, 40]] = float("nan")  # the first NaN
    x[7, 999] = float("inf")
    x[8, :] = 1.5  # all equal
    x[9, 0] = float("nan")
    x[10, 17] = float("inf")
    x[10, 18] = float("nan")
    x[11, 999] = 7.0  # the maximum last
    return x.contiguous()


@pytest.mark.parametrize("spans", [1, 2, 3, 7, 64])
def test_rows_argmax_is_numpys(spans: int) -> None:
    x = _rows()
    want = np.argmax(x.numpy(), axis=-1)
    assert rows_argmax(x, spans).tolist() == want.tolist()


def test_rows_argmax_short_rows() -> None:
    """Rows shorter than the spans (empty spans) and of one element."""
    x = torch.tensor([[3.0, 1.0, 3.0], [float("-inf"), 2.0, float("nan")]])
    assert rows_argmax(x, 8).tolist() == [0, 2]
    assert rows_argmax(torch.tensor([[4.0]]), 4).tolist() == [0]
    with pytest.raises(ValueError, match="float32"):
        rows_argmax(torch.zeros(2, 3, dtype=torch.float64))


def _runner(llm: LLM) -> Any:
    return llm.engine.core.executor.runner  # type: ignore[attr-defined]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_step_argmax_gives_the_greedy_tokens(
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy requests take the step's argmax (it ran: counted), and every row's argmax
    equals numpy's over the logits the step returned, on 2 threads (two spans a row).
    The tokens equal the module path's (tests/test_fused_decode.py compares the rest)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # what the step is given
    llm = LLM(tiny_model_factory("llama"), quantization=quantization, max_model_len=64,
              num_kv_blocks=64)  # fmt: skip
    runner = _runner(llm)
    assert runner.head_argmax
    plan = runner.model.model.decode_plan
    run, seen = plan.run, []

    def checked(*args: Any) -> torch.Tensor:
        out = run(*args)
        if len(args) > 12 and args[12] is not None:
            seen.append((args[11].clone(), args[12].clone()))
        return out

    monkeypatch.setattr(plan, "run", checked)
    prompts = [{"prompt_token_ids": [5 + i, 40, 41, 42 + i]} for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert seen, "the step's argmax never ran"
    for logits, argmax in seen:
        assert argmax.tolist() == np.argmax(logits.numpy(), axis=-1).tolist()
    monkeypatch.setattr(runner, "head_argmax", False)
    seen.clear()
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not seen and on == off


def test_changed_logits_do_not_take_the_step_argmax(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows whose logits the sampler changes first (penalties; min_tokens banning
    a stop token) sample from the changed logits, not the step's argmax: the same tokens
    as with the step's argmax off, and not the unchanged logits' tokens."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=64, num_kv_blocks=64)
    runner = _runner(llm)
    assert runner.head_argmax
    prompts = [{"prompt_token_ids": [7, 8, 7, 8, 7 + i]} for i in range(2)]

    def run(params: SamplingParams) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    base = run(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    firsts = sorted({b[0] for b in base})
    cases = [
        # The first tokens banned until 3 tokens are out: each row's first token changes.
        SamplingParams(max_tokens=6, temperature=0, min_tokens=3, stop_token_ids=firsts),
        # Every token seen in the prompt or output pulled up hard (penalty < 1).
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=0.01, ignore_eos=True),
    ]  # fmt: skip
    for params in cases:
        on = run(params)
        monkeypatch.setattr(runner, "head_argmax", False)
        off = run(params)
        monkeypatch.undo()
        assert on == off
        assert on != [b[: len(on[0])] for b in base], (params, on, base)
