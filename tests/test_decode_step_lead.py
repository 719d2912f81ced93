"""Lead steps (kernels/decode_step.c, lead_step): a one-sequence, one-row step on 2
threads runs its layers on one thread as a team of one and its LM head on both. The
results must be the team's bit for bit: captured one-row steps of each weight kind
replayed as a team and as lead steps give equal hidden states, logits and argmax; a whole
greedy run gives the module path's tokens; the switches do what they say."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import native
from helpers import captured_steps, replay_step

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def _plan(llm: LLM) -> Any:
    return llm.engine.core.executor.runner.model.model.decode_plan  # type: ignore[attr-defined]


def _llm(path: str, weights: str) -> LLM:
    kinds: dict[str, dict[str, Any]] = {
        "float32": {},
        "bf16": {"bf16_weights": True},
        "int8 dot layout": {"quantization": "int8", "int8_activations": True},
        "int8 float activations": {"quantization": "int8"},
    }
    return LLM(path, max_model_len=128, block_size=4, num_kv_blocks=256, **kinds[weights])


def _one_row_steps(llm: LLM, max_tokens: int) -> list[tuple[Any, ...]]:
    """The arguments of every one-row C step of one greedy request (bursts off: each
    token through DecodePlan.run)."""
    plan = _plan(llm)
    runner = llm.engine.core.executor.runner  # type: ignore[attr-defined]
    burst, runner.burst = runner.burst, None
    seen: list[tuple[Any, ...]] = []
    run = plan.run

    def capture(*args: Any) -> torch.Tensor:
        if args[0].shape[0] == 1:
            seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return run(*args)

    plan.run = capture
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(5, 18))}], params, use_tqdm=False)
    finally:
        del plan.run
        runner.burst = burst
    return seen


def _replay(plan: Any, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = plan.run(*args)
    return (out, *(a for a in args[10:] if isinstance(a, torch.Tensor)))


@pytest.mark.parametrize(
    "weights", ["float32", "bf16", "int8 dot layout", "int8 float activations"]
)
def test_lead_steps_give_the_team_bits(
    weights: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if weights == "bf16" and not native():
        pytest.skip("no native bf16 here")
    llm = _llm(tiny_model_factory("llama"), weights)
    plan = _plan(llm)
    # the default: verifications too where every layer weight is in the dot layout
    assert plan.lead_max_rows == (16 if weights == "int8 dot layout" else 1)
    steps = _one_row_steps(llm, 12)
    assert len(steps) >= 10
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    plan.lead_max_rows = 0
    before = plan.lead_steps
    team = [_replay(plan, a) for a in steps]
    assert plan.lead_steps == before
    plan.lead_max_rows = 1
    before = plan.lead_steps
    lead = [_replay(plan, a) for a in steps]
    assert plan.lead_steps - before == len(steps)
    for t, s in zip(team, lead, strict=True):
        for a, b in zip(t, s, strict=True):
            assert torch.equal(a, b)
    # Only on exactly 2 threads: more run as a team.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    before = plan.lead_steps
    _replay(plan, steps[0])
    assert plan.lead_steps == before


def test_shared_gemvs_give_the_team_bits(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second thread taking chunks of every projection's weight rows (one panel of 16
    rows a chunk; wide MLP weights, so that the first thread does not finish a GEMV
    before the second arrives): the team's bits."""
    llm = _llm(tiny_model_factory("llama", intermediate_size=4096), "int8 dot layout")
    plan = _plan(llm)
    assert plan.lead_share == ("gate_up", "down")  # the default
    steps = _one_row_steps(llm, 12)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    plan.lead_max_rows = 0
    team = [_replay(plan, a) for a in steps]
    plan.lead_max_rows = 1
    plan.lead_share = ("qkv", "o", "gate_up", "down", "attention")
    assert plan.lead_prefetch_bytes > 0  # the default: tails read ahead (reads only)
    # No spin: the second thread sleeps after each GEMV and is woken by the next (a
    # spinning one may share a core with the first on a busy machine and never come).
    plan.tune_lead_share(spin_us=0, chunk_bytes=1)
    first, second = plan.lead_chunks
    items = plan.lead_items
    for _ in range(50):  # until the second thread has taken some (it may be preempted)
        lead = [_replay(plan, a) for a in steps]
        for t, s in zip(team, lead, strict=True):
            for a, b in zip(t, s, strict=True):
                assert torch.equal(a, b)
        if plan.lead_chunks[1] > second and plan.lead_items[1] > items[1]:
            break
    assert plan.lead_chunks[0] > first
    assert plan.lead_chunks[1] > second
    # the one-row attention as an item per kv head, thread 1 taking some
    assert plan.lead_items[1] > items[1]
    plan.lead_share = ()
    before = plan.lead_chunks
    _replay(plan, steps[0])
    assert plan.lead_chunks == before


def _verification(steps: list[tuple[Any, ...]], first: int, rows: int) -> tuple[Any, ...]:
    """The verification step of `rows` rows that one-row steps first .. first + rows - 1
    of one sequence make together (the drafts all accepted): their rows, positions and
    slots in one query, the last step's cache length and table, every row's logits and
    argmax."""
    group = steps[first : first + rows]
    last = group[-1]
    vocab = last[11].shape[1]
    return (
        torch.cat([s[0] for s in group]),
        *(torch.cat([s[i] for s in group]) for i in (1, 2, 3)),
        torch.zeros(1, dtype=torch.int64),
        torch.tensor([rows], dtype=torch.int64),
        last[6].clone(),
        last[7].clone(),
        None,
        None,
        torch.arange(rows, dtype=torch.int64),
        torch.zeros(rows, vocab),
        torch.zeros(rows, dtype=torch.int64),
    )


@pytest.mark.parametrize("weights", ["int8 dot layout", "bf16", "int8 float activations"])
def test_verification_lead_steps_give_the_team_bits(
    weights: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verification steps (one sequence, 2 to 16 rows) as lead steps whose second thread
    takes items of each row's heads and attention and chunks of every projection (one
    panel a chunk, no spin: it comes late or not at all on a busy machine), and as lead
    steps sharing what a one-row step shares: the team's hidden states, logits and argmax.
    Past the decode-sized shares' 8 rows only plans whose weights multiply a row the same
    whatever the other rows (the dot layout, bf16) run as lead steps. Each case runs as
    the team and then as lead steps before the next: a replay rewrites its rows' keys and
    values, which a later case with other rows may read (bits that differ from the one-row
    steps' where the weights depend on the call's rows)."""
    if weights == "bf16" and not native():
        pytest.skip("no native bf16 here")
    llm = _llm(tiny_model_factory("llama", intermediate_size=4096), weights)
    plan = _plan(llm)
    steps = _one_row_steps(llm, 40)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    plan.tune_lead_share(spin_us=0, chunk_bytes=1)
    independent = weights != "int8 float activations"
    every = ("qkv", "o", "gate_up", "down", "heads", "attention")
    items = plan.lead_items
    for first, rows in ((3, 2), (10, 7), (0, 8), (5, 9), (20, 13), (22, 16)):
        case = _verification(steps, first, rows)
        plan.lead_max_rows = 0
        team = _replay(plan, case)
        plan.lead_max_rows = 16
        for multi in ((), every):
            plan.lead_multi = multi
            before = plan.lead_steps
            for _ in range(20):  # until the second thread takes items (it may be preempted)
                lead = _replay(plan, case)
                for a, b in zip(team, lead, strict=True):
                    assert torch.equal(a, b)
                if not multi or not independent or plan.lead_items[1] > items[1]:
                    break
            ran = plan.lead_steps - before
            assert ran > 0 if independent or rows <= 8 else ran == 0
            if not multi:
                assert plan.lead_items[1] == items[1]  # nothing but GEMVs shared
            items = plan.lead_items
    if independent:
        assert plan.lead_items[1] > 0


def test_lead_steps_of_a_few_sequences_give_the_team_bits(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 2-4 sequences and at most 16 rows (decodes beside prefill chunks of 12
    rows a step) as lead steps sharing everything lead_multi names: the team's bits;
    steps of 5 sequences run as a team."""
    llm = LLM(
        tiny_model_factory("llama", intermediate_size=4096), max_model_len=128, block_size=4,
        num_kv_blocks=256, quantization="int8", int8_activations=True,
        max_num_batched_tokens=12, max_num_seqs=5,
    )  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 3 * i))} for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plan, steps = captured_steps(llm, prompts, params)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    plan.tune_lead_share(spin_us=0, chunk_bytes=1)
    seqs = [int(a[4].shape[0]) for a in steps]
    few = [a for a, n in zip(steps, seqs, strict=True) if 2 <= n <= 4 and a[0].shape[0] <= 16]
    assert len(few) >= 5 and 5 in seqs
    for args in steps:
        plan.lead_max_rows = 0
        team = replay_step(plan, args)
        plan.lead_max_rows = 16
        before = plan.lead_steps
        lead = replay_step(plan, args)
        for a, b in zip(team, lead, strict=True):
            assert torch.equal(a, b)
        expected = args[4].shape[0] <= 4 and args[0].shape[0] <= 16
        assert plan.lead_steps - before == int(expected)


def test_lead_run_gives_the_module_path_tokens(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(tiny_model_factory("llama"), "int8 dot layout")
    plan = _plan(llm)
    runner = llm.engine.core.executor.runner  # type: ignore[attr-defined]
    monkeypatch.setattr(runner, "burst", None)  # every token through DecodePlan.run
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (5, 11)]
    lead = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert plan.lead_steps >= 2 * 15
    llm.engine.core.block_manager.reset_prefix_cache()  # type: ignore[attr-defined]
    monkeypatch.setattr(runner.model.model, "decode_plan", None)
    module = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    for a, b in zip(lead, module, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert x.keys() == y.keys()
            for tok in x:
                assert abs(x[tok] - y[tok]) < 1e-5


def test_lead_switches(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="lead_max_rows"):
        _plan(LLM(path, max_model_len=64)).lead_max_rows = -1
    monkeypatch.setenv("FLEETSERVE_LEAD_STEPS", "0")
    assert _plan(LLM(path, max_model_len=64)).lead_max_rows == 0
    monkeypatch.setenv("FLEETSERVE_LEAD_STEPS", "8")
    assert _plan(LLM(path, max_model_len=64)).lead_max_rows == 8
    monkeypatch.setenv("FLEETSERVE_LEAD_SHARE", "none")
    assert _plan(LLM(path, max_model_len=64)).lead_share == ()
    monkeypatch.setenv("FLEETSERVE_LEAD_SHARE", "down, qkv")
    assert _plan(LLM(path, max_model_len=64)).lead_share == ("qkv", "down")
    monkeypatch.setenv("FLEETSERVE_LEAD_SHARE", "attention,down")
    assert _plan(LLM(path, max_model_len=64)).lead_share == ("down", "attention")
    for bad in ("mlp", "heads"):  # a one-row step's heads are not items
        monkeypatch.setenv("FLEETSERVE_LEAD_SHARE", bad)
        with pytest.raises(ValueError, match="lead_share"):
            LLM(path, max_model_len=64)
    monkeypatch.delenv("FLEETSERVE_LEAD_SHARE")
    monkeypatch.setenv("FLEETSERVE_LEAD_MULTI", "none")
    assert _plan(LLM(path, max_model_len=64)).lead_multi == ()
    monkeypatch.setenv("FLEETSERVE_LEAD_MULTI", "attention,qkv")
    assert _plan(LLM(path, max_model_len=64)).lead_multi == ("qkv", "attention")
    monkeypatch.setenv("FLEETSERVE_LEAD_MULTI", "rope")
    with pytest.raises(ValueError, match="lead_multi"):
        LLM(path, max_model_len=64)
    monkeypatch.delenv("FLEETSERVE_LEAD_MULTI")
    default = ("qkv", "o", "gate_up", "down", "attention")
    assert _plan(LLM(path, max_model_len=64)).lead_multi == default
    monkeypatch.setenv("FLEETSERVE_LEAD_SPIN_US", "-5")
    with pytest.raises(ValueError, match="FLEETSERVE_LEAD_SPIN_US"):
        LLM(path, max_model_len=64)
    monkeypatch.delenv("FLEETSERVE_LEAD_SPIN_US")
    plan = _plan(LLM(path, max_model_len=64))
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan.tune_lead_share(spin_us=50, chunk_bytes=0)
    with pytest.raises(ValueError, match="spin_us"):
        plan.tune_lead_share(spin_us=-1, chunk_bytes=16384)
    assert plan.lead_prefetch_bytes == 768 * 1024
    with pytest.raises(ValueError, match="lead_prefetch_bytes"):
        plan.lead_prefetch_bytes = -1
    monkeypatch.setenv("FLEETSERVE_LEAD_PREFETCH_KB", "0")
    assert _plan(LLM(path, max_model_len=64)).lead_prefetch_bytes == 0
    monkeypatch.setenv("FLEETSERVE_LEAD_PREFETCH_KB", "64")
    assert _plan(LLM(path, max_model_len=64)).lead_prefetch_bytes == 64 * 1024
    monkeypatch.setenv("FLEETSERVE_LEAD_PREFETCH_KB", "-1")
    with pytest.raises(ValueError, match="FLEETSERVE_LEAD_PREFETCH_KB"):
        LLM(path, max_model_len=64)
    monkeypatch.delenv("FLEETSERVE_LEAD_PREFETCH_KB")
    monkeypatch.setenv("FLEETSERVE_LEAD_STEPS", "on")
    with pytest.raises(ValueError, match="FLEETSERVE_LEAD_STEPS"):
        LLM(path, max_model_len=64)
