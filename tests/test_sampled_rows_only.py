"""A wide step's last layer on its sampled rows alone (kernels/decode_step.c, team_step's
`prune`): when nothing reads the other rows' hidden states (no prompt logprobs), the C
step runs the last layer's o projection, norms and MLP on the rows whose logits are
sampled. Those rows' hidden states, logits and argmax must be the full step's bits, at 1
to 3 threads, as one team or split by sequences; the other rows are left unwritten; plans
whose weights depend on the call's rows ignore the request; prompt logprobs still see
every row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import native
from fleetserve.kernels.decode_step import _lib
from helpers import captured_steps

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or not native(), reason="no C compiler or no native bf16 here"
)

# Positional arguments of DecodePlan.run as run_decode passes them.
ROWS, LOGITS, ARGMAX, ONLY = 10, 11, 12, 13


def _plan(llm: LLM) -> Any:
    return llm.engine.core.executor.runner.model.model.decode_plan  # type: ignore[attr-defined]


def _prompts(n: int, seed: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(3, 400, (int(9 + 13 * i % 41),), generator=g).tolist()}
        for i in range(n)
    ]


def _captured(llm: LLM, n: int, max_tokens: int) -> list[tuple[Any, ...]]:
    """The arguments of every C step of n greedy requests."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return captured_steps(llm, _prompts(n, 3), params)[1]


def _replay(
    plan: Any, args: tuple[Any, ...], only: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, ...]:
    """(hidden states, logits, argmax) of the step; its result starts as NaN rows, so rows
    the step leaves unwritten stay NaN."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    args = (*args[:ONLY], only)
    empty = torch.empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *s, **k: empty(*s, **k).fill_(float("nan")))
        out = plan.run(*args)
    return out, args[LOGITS], args[ARGMAX]


def _wide_and_pruned(args: tuple[Any, ...]) -> bool:
    rows = args[ROWS]
    m = args[0].shape[0]
    return rows is not None and m > _lib().decode_step_max_rows() and rows.shape[0] < m


def _llm(tiny_model_factory: Callable[..., str], weights: str) -> LLM:
    kw: dict[str, Any] = (
        {"bf16_weights": True}
        if weights == "bf16"
        else {"quantization": "int8", "int8_activations": True}  # the dot layout
    )
    return LLM(
        tiny_model_factory("llama"), max_model_len=160, block_size=4, num_kv_blocks=640,
        max_num_batched_tokens=96, max_num_seqs=16, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("weights", ["bf16", "int8 dot layout"])
def test_sampled_rows_are_the_full_steps_bits(
    weights: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(tiny_model_factory, weights)
    plan = _plan(llm)
    steps = [a for a in _captured(llm, 16, 6) if _wide_and_pruned(a)]
    assert len(steps) >= 3
    # The runner asks for it: no request wants prompt logprobs.
    assert all(a[ONLY] for a in steps)
    default = plan.split_min_rows
    try:
        for threads, split_rows in ((1, 0), (2, 0), (3, 0), (2, 1), (3, 1)):
            monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
            plan.split_min_rows = split_rows
            for a in steps:
                full_out, full_logits, full_argmax = _replay(plan, a, False, monkeypatch)
                out, logits, argmax = _replay(plan, a, True, monkeypatch)
                rows = a[ROWS]
                assert not full_out.isnan().any()
                assert torch.equal(out[rows], full_out[rows])
                assert torch.equal(logits, full_logits)
                assert torch.equal(argmax, full_argmax)
                if split_rows == 0:  # one team: every other row left as it was
                    others = torch.ones(out.shape[0], dtype=torch.bool)
                    others[rows] = False
                    assert out[others].isnan().all()
    finally:
        plan.split_min_rows = default


def test_row_dependent_plans_ignore_it(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # int8 weights with float32 activations: wide and narrow steps' kernels differ.
    llm = LLM(
        tiny_model_factory("llama"), quantization="int8", max_model_len=160, block_size=4,
        num_kv_blocks=640, max_num_batched_tokens=96, max_num_seqs=16,
    )  # fmt: skip
    plan = _plan(llm)
    steps = [a for a in _captured(llm, 16, 4) if _wide_and_pruned(a)]
    assert steps
    for a in steps:
        full = _replay(plan, a, False, monkeypatch)
        asked = _replay(plan, a, True, monkeypatch)
        assert not asked[0].isnan().any()
        for x, y in zip(full, asked, strict=True):
            assert torch.equal(x, y)


def test_prompt_logprobs_see_every_row(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a request that wants prompt logprobs keeps every row: its prompt
    logprobs equal the module path's (within bf16 GEMMs' 1e-5, as the other bf16 tests)."""
    llm = _llm(tiny_model_factory, "bf16")
    prompts = _prompts(6, 4)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with_lps = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1)
    params = [with_lps if i == 2 else plain for i in range(len(prompts))]
    c_step = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.core.block_manager.reset_prefix_cache()
    runner = llm.engine.core.executor.runner  # type: ignore[attr-defined]
    monkeypatch.setattr(runner.model.model, "decode_plan", None)
    module = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(c_step, module, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    got, want = c_step[2].prompt_logprobs, module[2].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(prompts[2]["prompt_token_ids"])
    for x, y in zip(got[1:], want[1:], strict=True):
        assert x is not None and y is not None and x.keys() == y.keys()
        for tok in x:
            assert abs(x[tok] - y[tok]) < 1e-5


def test_a_chunk_with_no_sampled_row_stops_after_its_attention(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt alone: its first chunk samples nothing (an empty `logit_rows`, every
    row of the result left unwritten), and the run still gives the module path's tokens
    and logprobs (the later chunks read the K/V that chunk wrote)."""
    llm = _llm(tiny_model_factory, "bf16")
    plan = _plan(llm)
    prompt = {"prompt_token_ids": [(7 * i) % 397 + 3 for i in range(150)]}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    seen: list[tuple[Any, ...]] = []
    run = plan.run

    def capture(*args: Any) -> torch.Tensor:
        seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return run(*args)

    monkeypatch.setattr(plan, "run", capture)
    c_step = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    monkeypatch.undo()
    first = seen[0]
    assert first[0].shape[0] == 96 and first[ROWS].shape == (0,) and first[ONLY]
    out, logits, _ = _replay(plan, first, True, monkeypatch)
    assert out.isnan().all() and logits.shape == (0, plan.vocab)
    llm.engine.core.block_manager.reset_prefix_cache()
    runner = llm.engine.core.executor.runner  # type: ignore[attr-defined]
    monkeypatch.setattr(runner.model.model, "decode_plan", None)
    module = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert c_step.token_ids == module.token_ids
    for x, y in zip(c_step.logprobs or [], module.logprobs or [], strict=True):
        assert x.keys() == y.keys()
        for tok in x:
            assert abs(x[tok] - y[tok]) < 1e-5
