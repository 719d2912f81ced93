"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) match HF transformers.

Greedy tokens equal HF's and logprobs are within 1e-4 on tiny random checkpoints built
with transformers' own classes, under the settings that change how tokens reach the
experts: whole prompts in one batch, chunked prefill, preemption with recompute, and
decode batches. The grouped-experts C kernel is checked against its torch reference on
its own (float32 and GGUF blocks, a subset of local experts as under expert parallelism).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fleetserve.config import ModelConfig
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from test_hf_parity import (
    GREEDY,
    PROMPTS,
    SETTINGS,
    check_logprobs_match_hf,
    hf_greedy,
    hf_logprobs,
    hf_model,
    run_engine,
)

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_model(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory(request.param)


def assert_greedy_parity(path: str, setting: str, n: int = 1, **extra: object) -> None:
    kw, must_preempt = SETTINGS[setting]
    tokens, core, _ = run_engine(path, GREEDY, n=n, **kw, **extra)
    for i, expected in enumerate(hf_greedy(path)):
        for k in range(n):
            rid = f"{i}#{k}" if n > 1 else str(i)
            assert tokens[rid] == expected, f"prompt {i} (len {len(PROMPTS[i])}) sibling {k}"
    if must_preempt:
        assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("setting", ["prefix_caching", "chunked_prefill", "small_kv_cache"])
def test_moe_greedy_matches_hf(moe_model: str, setting: str) -> None:
    assert_greedy_parity(moe_model, setting)


def test_moe_runs_the_grouped_kernel(moe_model: str) -> None:
    from fleetserve.engine.arg_utils import EngineArgs
    from fleetserve.engine.core import EngineCore
    from fleetserve.models.moe import MoeForCausalLM

    if cpu_kernels.load() is None or not cpu_kernels.gemm_worthwhile():
        pytest.skip("the experts stay on the torch path here")
    config, source = EngineArgs(model=moe_model, max_model_len=128).resolve()
    model = EngineCore(config, source).executor.runner.model
    assert isinstance(model, MoeForCausalLM)
    assert all(b.experts.kernel_weights is not None for b in model.moe_blocks())


def test_moe_torch_path_matches_hf(moe_model: str) -> None:
    # The plain-torch experts (GPUs, other dtypes) with siblings and prefill chunks.
    assert_greedy_parity(moe_model, "chunked_prefill", n=2, attention_backend="torch")


def test_moe_logprobs_match_hf(moe_model: str) -> None:
    check_logprobs_match_hf(moe_model, SETTINGS["chunked_prefill"][0])


def test_moe_checkpoints_route_to_every_expert(moe_model: str) -> None:
    """Guards the parity tests: the tiny checkpoints must use all their experts (and not
    say the same thing for every prompt), or a wrong expert could go unnoticed."""
    model = hf_model(moe_model)
    seen: set[int] = set()

    def hook(_mod: object, _inp: object, out: tuple[torch.Tensor, ...]) -> None:
        seen.update(out[2].reshape(-1).tolist())  # (logits, weights, ids)

    gate = model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(torch.tensor([PROMPTS[3]]))
    finally:
        handle.remove()
    assert seen == set(range(gate.num_experts))
    ref = hf_greedy(moe_model)
    assert len({tuple(r) for r in ref}) == len(ref)


def test_moe_config_fields(tiny_model_factory: Callable[..., str]) -> None:
    from fleetserve.models.loader import resolve_model

    q2 = ModelConfig.from_hf(resolve_model(tiny_model_factory("qwen2_moe")).hf_config)
    assert q2.moe is not None and q2.attention_bias and not q2.moe.norm_topk_prob
    assert q2.moe.shared_expert_intermediate_size == 96
    q3 = ModelConfig.from_hf(resolve_model(tiny_model_factory("qwen3_moe")).hf_config)
    assert q3.moe is not None and q3.qk_norm and q3.moe.norm_topk_prob
    assert q3.moe.num_experts == 8 and q3.moe.shared_expert_intermediate_size is None


def test_dense_layers_among_moe_layers_match_hf(tiny_model_factory: Callable[..., str]) -> None:
    # Qwen-MoE's mlp_only_layers: layer 0 keeps a dense MLP of intermediate_size.
    path = tiny_model_factory("qwen2_moe", mlp_only_layers=[0])
    assert ModelConfig.from_hf(hf_model(path).config.to_dict()).moe.sparse_layers == (1,)  # type: ignore[union-attr]
    assert_greedy_parity(path, "chunked_prefill")


@pytest.mark.parametrize(
    ("arch", "detail"),
    [
        ("DeepseekV3ForCausalLM", "multi-head latent attention"),
        ("DeepseekV2ForCausalLM", "multi-head latent attention"),
        ("PhimoeForCausalLM", "sparsemixer"),
    ],
)
def test_unsupported_moe_refused_by_name(arch: str, detail: str) -> None:
    with pytest.raises(ValueError, match=f"{arch}.*{detail}"):
        ModelConfig.from_hf({"architectures": [arch], "hidden_size": 64})


def test_moe_sliding_window_refused() -> None:
    hf = {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
    }
    with pytest.raises(ValueError, match="sliding_window=16"):
        ModelConfig.from_hf(hf)
    hf["num_experts_per_tok"] = 5
    hf["sliding_window"] = None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(hf)


# ------------------------------------------------------------ the grouped kernel
def _routing(t: int, k: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 17, 200])
@pytest.mark.parametrize(("first", "num_local"), [(0, 6), (2, 3)])
def test_grouped_kernel_matches_torch(tokens: int, first: int, num_local: int) -> None:
    from fleetserve.kernels.moe import ExpertWeights, grouped_experts, grouped_experts_torch

    hidden, inter, num_experts, k = 64, 48, 6, 2
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / 8
    w2 = torch.randn(num_local, hidden, inter, generator=g) / 7
    ids, wts = _routing(tokens, k, num_experts, tokens)
    want = grouped_experts_torch(x, ids, wts, w13, w2, first)
    experts = ExpertWeights(
        gate_up=[[cpu_kernels.PackedWeight(w13[e])] for e in range(num_local)],
        down=[cpu_kernels.PackedWeight(w2[e]) for e in range(num_local)],
        hidden_size=hidden,
        intermediate_size=inter,
    )
    got = grouped_experts(x, ids, wts, experts, first)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if num_local < num_experts:  # tokens whose experts are all elsewhere get zeros
        none_here = ((ids < first) | (ids >= first + num_local)).all(dim=1)
        assert (got[none_here] == 0).all()


@needs_kernels
@pytest.mark.parametrize("tokens", [2, 40])
def test_grouped_kernel_quantized_experts(tokens: int) -> None:
    """GGUF experts (gate and up as two segments of different block types) against the
    torch reference on their dequantized weights."""
    from fleetserve.kernels.moe import ExpertWeights, grouped_experts, grouped_experts_torch
    from fleetserve.kernels.quant import QType, QuantWeight
    from fleetserve.models.quantize import quantize_q8_0

    hidden, inter, num_experts, k = 64, 32, 4, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=g)
    gate = torch.randn(num_experts, inter, hidden, generator=g) / 8
    up = torch.randn(num_experts, inter, hidden, generator=g) / 8
    down = torch.randn(num_experts, hidden, inter, generator=g) / 6

    def q8(w: torch.Tensor) -> QuantWeight:
        return QuantWeight(QType.Q8_0, quantize_q8_0(w), w.shape[1])

    gu = [[q8(gate[e]), QuantWeight(QType.Q8_0, quantize_q8_0(up[e]), hidden)] for e in range(4)]
    dn = [q8(down[e]) for e in range(num_experts)]
    experts = ExpertWeights(gu, dn, hidden, inter)
    w13 = torch.stack([torch.cat([s.dequantize() for s in segs]) for segs in gu])
    w2 = torch.stack([d.dequantize() for d in dn])
    ids, wts = _routing(tokens, k, num_experts, 9)
    got = grouped_experts(x, ids, wts, experts)
    torch.testing.assert_close(
        got, grouped_experts_torch(x, ids, wts, w13, w2), atol=2e-4, rtol=1e-4
    )


@needs_kernels
def test_int8_keeps_routers_float(tiny_model_factory: Callable[..., str]) -> None:
    """quantization="int8" makes Q8_0 of the attention and shared-expert projections; the
    routers stay float32 (a rounding error there swaps experts) and so do the experts."""
    from fleetserve import LLM
    from fleetserve.layers.linear import Linear
    from fleetserve.layers.quant_linear import QuantLinear
    from fleetserve.models.moe import MoeForCausalLM

    path = tiny_model_factory("qwen2_moe")
    llm = LLM(path, quantization="int8", max_model_len=128)
    model = llm.engine.core.executor.runner.model  # type: ignore[attr-defined]
    assert isinstance(model, MoeForCausalLM)
    block = model.moe_blocks()[0]
    assert isinstance(block.gate, Linear) and isinstance(block.shared_expert_gate, Linear)
    assert block.shared_expert is not None
    assert isinstance(block.shared_expert.gate_up_proj, QuantLinear)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    ids = PROMPTS[3] + PROMPTS[2]
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    top1 = [max(row, key=row.__getitem__) for row in out.prompt_logprobs[1:]]  # type: ignore[union-attr]
    ref = hf_logprobs(path, ids)[:-1].argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(top1, ref, strict=True)) / len(ref)
    assert agree >= 0.9, agree
    llm.engine.shutdown()
