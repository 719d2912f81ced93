"""bf16 weights (EngineConfig.bf16_weights; layers/linear.py `to_bf16`): the module path's
linear layers and the C step's W_BF16 kind multiply through the same gemm_bf16 share, so
the two agree as the float32 and quantized kinds do (tests/test_fused_decode.py), and the
model stays close to its float32 self."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fleetserve import LLM
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import bf16_kernel_rows
from fleetserve.layers.linear import Linear
from test_fused_decode import _assert_same, _Counted, _generate, _prompts, _runner

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_linear_to_bf16_matches_rounded_reference(m: int) -> None:
    """Up to bf16_kernel_rows rows: gemm_bf16, float32 outputs; more: torch's bf16
    matmul, whose outputs are rounded to bf16 (relative error up to 2^-8)."""
    g = torch.Generator().manual_seed(m)
    lin = Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    w = lin.weight.detach().clone()
    lin.to_bf16()
    assert lin.bf16 is not None and lin.bf16.dtype == torch.bfloat16
    assert lin.weight.numel() == 0  # the bf16 copy is the weight now
    x = torch.randn(1, m, 96, generator=g)
    want = x.bfloat16().double() @ w.bfloat16().double().T + lin.bias.double()
    got = lin(x)
    assert got.shape == (1, m, 40) and got.dtype == torch.float32
    if m <= bf16_kernel_rows():
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=0.05)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_c_step_and_module_path_same_tokens(
    arch: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps up to the decode-sized row limit run in C (the W_BF16 share); the same with
    the plan taken away run gemm_bf16 on the module path: identical tokens, logprobs
    within 1e-5. Wider steps (the prompts here) take torch's bf16 matmul both times."""
    llm = LLM(
        tiny_model_factory(arch), bf16_weights=True, max_model_len=128, block_size=4,
        num_kv_blocks=160,
    )  # fmt: skip
    runner = _runner(llm)
    assert runner.model.model.layers[0].self_attn.qkv_proj.bf16 is not None
    plan = runner.model.model.decode_plan
    assert plan is not None and plan.has_bf16
    counted = _Counted(plan)
    monkeypatch.setattr(plan, "run", counted)
    few = _prompts(3, 500, seed=3, step=3)
    on = _generate(llm, few, 12)
    assert counted.steps >= 11 and counted.rows >= 3 * 11  # the 3-row decode steps
    llm.engine.core.block_manager.reset_prefix_cache()  # type: ignore[attr-defined]
    monkeypatch.setattr(runner.model.model, "decode_plan", None)
    off = _generate(llm, few, 12)
    _assert_same(on, off)


def test_close_to_float32(tiny_model_factory: Callable[..., str]) -> None:
    """The first greedy token of each prompt is float32's, and its logprob within 0.05
    nats (bf16 rounds weights and GEMM inputs; the rest stays float32)."""
    path = tiny_model_factory("llama")
    prompts = _prompts(4, 500, seed=5, step=5)
    kw = dict(max_model_len=128, block_size=4, num_kv_blocks=96)
    bf = _generate(LLM(path, bf16_weights=True, **kw), prompts, 1)
    fp = _generate(LLM(path, **kw), prompts, 1)
    for (t_bf, lp_bf), (t_fp, lp_fp) in zip(bf, fp, strict=True):
        assert t_bf == t_fp
        tok = t_fp[0]
        assert abs(lp_bf[0][tok] - lp_fp[0][tok]) < 0.05


def test_refused_where_it_cannot_run(tiny_model_factory: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="bf16_weights"):
        LLM(tiny_model_factory("llama"), bf16_weights=True, quantization="int8")
