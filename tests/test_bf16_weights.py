"""bf16 weights (EngineConfig.bf16_weights; layers/linear.py `to_bf16`): the module path's
linear layers and the C step's W_BF16 kind multiply through the same gemm_bf16 share, so
the two agree as the float32 and quantized kinds do (tests/test_fused_decode.py), and the
model stays close to its float32 self."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest
import torch

from fleetserve import LLM
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import gemm_bf16
from fleetserve.layers.linear import Linear
from test_fused_decode import (
    _assert_same,
    _Counted,
    _generate,
    _on_and_off,
    _prompts,
    _runner,
)

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_linear_to_bf16_matches_rounded_reference(m: int) -> None:
    """Every row count through gemm_bf16 (AMX tiles past 8 rows where present): float32
    outputs of bf16-rounded inputs. Behaviour changed on purpose: past 8 rows this used
    to be torch's bf16 matmul, whose outputs are bf16 (the looser bound it had)."""
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
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


# (m, n, k): decode-sized rows (vdpbf16ps), AMX tiles with odd 16-row blocks and n tails
# of 16 and under 16, k not a multiple of 32 (vdpbf16ps at any m), a wide prefill shape,
# rows in several chunks (192 rows of k = 1024 each, the last one partial).
_SHAPES = [(3, 40, 64), (9, 48, 64), (16, 32, 32), (17, 40, 96), (33, 17, 64),
           (64, 50, 80), (200, 96, 576), (600, 48, 1024)]  # fmt: skip


@pytest.mark.parametrize(("m", "n", "k"), _SHAPES)
def test_gemm_bf16_against_torch(m: int, n: int, k: int) -> None:
    """Against torch's float32 matmul of the same bf16-rounded inputs: each output within
    2^-16 of the sum of its products' magnitudes (float32 accumulation in another order),
    and against torch's bf16 matmul within its bf16 output rounding (2^-8 relative)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    got = gemm_bf16(x, w, bias=bias)
    xr, wf = x.bfloat16().float(), w.float()
    bound = (xr.abs() @ wf.abs().T) * 2.0**-16 + 1e-6
    assert ((got - (xr @ wf.T + bias)).abs() <= bound).all()
    # torch's bf16 output rounds the sum before the bias is added (half an ulp: 2^-8).
    torch_dot = torch.nn.functional.linear(x.bfloat16(), w).float()
    assert ((got - bias - torch_dot).abs() <= torch_dot.abs() * 2.0**-8 + bound).all()


def test_rows_chunked_or_not_give_the_same_sums() -> None:
    """A row's outputs do not depend on how many rows share the call: many rows are
    multiplied a chunk at a time (gemm_bf16.c's amx_chunk_blocks), each output over k in
    one order. Rows of one 1,100-row call (k = 768: chunks of 256 rows) against the same
    rows in calls of their own (10-40 rows: one chunk), bit for bit."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1100, 768, generator=g)
    w = torch.randn(56, 768, generator=g).bfloat16()
    whole = gemm_bf16(x, w, threads=2)
    for r0, r1 in ((0, 16), (250, 270), (512, 552), (1090, 1100)):
        assert torch.equal(whole[r0:r1], gemm_bf16(x[r0:r1], w, threads=1)), (r0, r1)


def test_amx_switch_gives_the_same_sums() -> None:
    """FLEETSERVE_AMX=0 (the A/B switch, read once per process) keeps `vdpbf16ps` for
    every row count: the same products, summed in another order."""
    code = (
        "import torch; from fleetserve.kernels.bf16 import gemm_bf16;"
        "g = torch.Generator().manual_seed(0); x = torch.randn(40, 96, generator=g);"
        "w = torch.randn(48, 96, generator=g).bfloat16();"
        "torch.save(gemm_bf16(x, w), __import__('sys').argv[1])"
    )
    outs = []
    with tempfile.TemporaryDirectory() as d:
        for amx in ("1", "0"):
            path = os.path.join(d, f"amx{amx}.pt")
            env = {**os.environ, "FLEETSERVE_AMX": amx}
            subprocess.run([sys.executable, "-c", code, path], env=env, check=True, timeout=120)
            outs.append(torch.load(path))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_c_step_and_module_path_same_tokens(
    arch: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps run in C (the W_BF16 share); the same with the plan taken away run
    gemm_bf16 on the module path: identical tokens, logprobs within 1e-5."""
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_wide_steps_run_in_c(
    arch: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step of a bf16 model stays in the C step, LM head included: prefill chunks
    mixed with decodes, a second wave after cached context, and more decode rows than
    the decode-sized shares take (AMX tiles where present). Tokens identical to the
    module path, logprobs within 1e-5. Behaviour changed on purpose: steps past 8 rows
    used to leave for the module path (torch's bf16 matmul)."""
    llm = LLM(
        tiny_model_factory(arch), bf16_weights=True, max_model_len=160, block_size=4,
        num_kv_blocks=320, max_num_batched_tokens=24,
    )  # fmt: skip
    plan = _runner(llm).model.model.decode_plan
    assert plan is not None and plan.has_bf16 and plan.head_bf16
    n = plan.max_rows + 4
    prompts = _prompts(n, 500, seed=6, step=5)  # 5 .. 60 tokens, cut into 24-token steps
    on, off, counted = _on_and_off(llm, prompts, 8, monkeypatch, waves=2)
    _assert_same(on, off)
    assert counted.mixed > 0 and counted.multi_row_with_context > 0
    assert max(m for m, _ in counted.head_steps) > plan.max_rows


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
