"""Random test checkpoints: loadable by transformers, non-degenerate, shaped as asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fleetserve.models.loader import resolve_model
from fleetserve.models.make_model import main, make_model

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
PROMPTS = ["The cat", "Hello world", "A small dog found the map"]


def _greedy(folder: str, prompt: str, num_tokens: int = 20) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", sorted(ARCH_CLASSES))
def test_each_arch_loads_in_transformers_and_generates(tiny_model_factory, arch):
    folder = tiny_model_factory(arch)
    config = json.loads(Path(folder, "config.json").read_text())
    assert config["architectures"] == [ARCH_CLASSES[arch]]
    assert config["vocab_size"] % 64 == 0
    for prompt in PROMPTS:
        tokens = _greedy(folder, prompt)
        assert len(tokens) == 20
        assert len(set(tokens)) >= 5, f"{arch} greedy output is degenerate: {tokens}"


def test_tied_embeddings_are_not_degenerate(tiny_model_factory):
    folder = tiny_model_factory("llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in resolve_model(folder).tensor_names()
    for prompt in PROMPTS:
        assert len(set(_greedy(folder, prompt))) >= 3


def test_arch_specific_tensors(tiny_qwen2, tiny_qwen3, tiny_llama):
    qwen2 = resolve_model(tiny_qwen2).tensor_names()
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2
    qwen3 = resolve_model(tiny_qwen3).tensor_names()
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3
    llama = resolve_model(tiny_llama)
    assert not any(n.endswith(".bias") for n in llama.tensor_names())
    # Norms are random around 1, so a model that skips a norm's weight gives other tokens.
    norm = llama.get_tensor("model.layers.0.input_layernorm.weight", torch.float32)
    assert not torch.allclose(norm, torch.ones_like(norm))


def test_overrides_shape_the_checkpoint(tiny_model_factory):
    source = resolve_model(tiny_model_factory("llama", num_key_value_heads=1, head_dim=32))
    assert source.get_tensor("model.layers.0.self_attn.q_proj.weight", torch.float32).shape == (
        4 * 32,
        64,
    )
    assert source.get_tensor("model.layers.0.self_attn.k_proj.weight", torch.float32).shape == (
        32,
        64,
    )
    assert source.hf_config["head_dim"] == 32
    assert len(set(_greedy(source.path, "The cat"))) >= 5


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_rope_scaling_override(tiny_model_factory, rope_scaling):
    folder = tiny_model_factory("llama", rope_scaling=rope_scaling)
    config = json.loads(Path(folder, "config.json").read_text())
    # transformers >= 5 writes rope_parameters; older versions rope_scaling.
    saved = config.get("rope_parameters") or config.get("rope_scaling")
    assert saved["rope_type"] == rope_scaling["rope_type"]
    assert saved["factor"] == rope_scaling["factor"]
    assert len(_greedy(folder, "The cat")) == 20


def test_tokenizer_files_and_chat_template(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads(Path(tiny_llama, "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    generation = json.loads(Path(tiny_llama, "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == [0, 2]


def test_seed_is_deterministic(tmp_path):
    a = resolve_model(make_model(str(tmp_path / "a"), "qwen3", seed=1))
    b = resolve_model(make_model(str(tmp_path / "b"), "qwen3", seed=1))
    c = resolve_model(make_model(str(tmp_path / "c"), "qwen3", seed=2))
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(a.get_tensor(name, torch.float32), b.get_tensor(name, torch.float32))
    assert not torch.equal(a.get_tensor(name, torch.float32), c.get_tensor(name, torch.float32))
    assert Path(a.path, "tokenizer.json").read_text() == Path(c.path, "tokenizer.json").read_text()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_model(str(tmp_path), "gpt2")
    with pytest.raises(ValueError, match="size"):
        make_model(str(tmp_path), "llama", "huge")
    with pytest.raises(ValueError, match="vocab_size"):
        make_model(str(tmp_path), "llama", vocab_size=64)


def test_cli_writes_a_checkpoint(tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert main([out, "--arch", "mistral", "--override", "num_key_value_heads=1"]) == 0
    assert capsys.readouterr().out.strip() == out
    assert resolve_model(out).hf_config["num_key_value_heads"] == 1


def test_bench_size(tmp_path):
    source = resolve_model(make_model(str(tmp_path / "bench"), "llama", "bench"))
    cfg = source.hf_config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (768, 12, 32000)
    assert cfg["tie_word_embeddings"] is False
    assert source.get_tensor("lm_head.weight", torch.float32).shape == (32000, 768)
