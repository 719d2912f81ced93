"""Sliding-window models against HF transformers on tiny random checkpoints (fp32).

Gemma 3 (local layers with a 16-token window between global ones, two RoPE bases,
GeGLU, four norms per layer, scaled embedding) and Mistral with `sliding_window: 16`:
prompts shorter and much longer than the window, in one batch, under the engine settings
that change how the K/V cache is filled (prefix caching, chunked prefill, preemption),
on the C kernel and the plain-torch backend; logprobs within 1e-4 of HF's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fleetserve.core.request import Request
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.core import EngineCore

NUM_TOKENS = 12
WINDOW = 16


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 15, 17, 40, 71)]
    prompts.append(prompts[4][:48] + [9, 8, 7])  # shares 3 blocks of 16 with prompt 4
    return prompts


PROMPTS = _prompts()

SETTINGS: dict[str, dict[str, Any]] = {
    "prefix_caching": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 7, "block_size": 4},
    "small_kv_cache": {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 32},
}
# Fewer blocks than the longest request's 83 tokens need: it fits only because blocks that
# slid out of every layer's window are freed (Mistral: every layer windowed).
WINDOW_KV_CACHE = {"num_kv_blocks": 18, "block_size": 4, "max_num_batched_tokens": 8}

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("gemma3", {"num_hidden_layers": 4}),
    "gemma3_tied_softcap": (
        "gemma3",
        {"num_hidden_layers": 3, "tie_word_embeddings": True, "final_logit_softcapping": 3.0},
    ),
    "mistral_window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
}

_REF: dict[str, list[list[int]]] = {}
_HF: dict[str, Any] = {}


def _hf(path: str) -> Any:
    if path not in _HF:
        from transformers import AutoModelForCausalLM

        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_greedy(path: str) -> list[list[int]]:
    """Greedy by full forwards without a cache (what generate's windowed caches must
    reproduce too)."""
    if path not in _REF:
        model = _hf(path)
        ref = []
        with torch.no_grad():
            for p in PROMPTS:
                seq = list(p)
                for _ in range(NUM_TOKENS):
                    seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
                ref.append(seq[len(p) :])
        _REF[path] = ref
    return _REF[path]


def run_engine(
    path: str, params: SamplingParams, **kw: Any
) -> tuple[dict[str, list[int]], EngineCore, dict[str, list]]:
    kw.setdefault("max_model_len", 128)
    config, source = EngineArgs(model=path, **kw).resolve()
    core = EngineCore(config, source)
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    for i, p in enumerate(PROMPTS):
        if i == len(PROMPTS) - 1:
            for out in core.step():  # prompt 4's first blocks are cached by now
                tokens[out.req_id] += out.new_token_ids
                lps[out.req_id] += out.new_logprobs or []
        core.add_request(Request(str(i), p, params))
        tokens[str(i)], lps[str(i)] = [], []
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.req_id] += out.new_token_ids
            lps[out.req_id] += out.new_logprobs or []
        core.block_manager.check_invariants()
    assert not core.has_unfinished_requests()
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    sliding = getattr(bm, "sliding", None)
    if sliding is not None:
        assert sliding.num_free_blocks == sliding.num_blocks, "window blocks leaked"
    return tokens, core, lps


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MODELS))
def model_path(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> str:
    arch, overrides = MODELS[request.param]
    return tiny_model_factory(arch, **overrides)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(model_path: str, setting: str, backend: str) -> None:
    ref = hf_greedy(model_path)
    tokens, core, _ = run_engine(model_path, GREEDY, attention_backend=backend, **SETTINGS[setting])
    for i, expected in enumerate(ref):
        assert tokens[str(i)] == expected, f"prompt {i} (len {len(PROMPTS[i])})"
    if setting == "small_kv_cache" and hasattr(core.block_manager, "sliding"):
        assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mistral_cache_smaller_than_a_request(
    tiny_model_factory: Callable[..., str], backend: str
) -> None:
    path = tiny_model_factory(*MODELS["mistral_window"][:1], **MODELS["mistral_window"][1])
    tokens, core, _ = run_engine(path, GREEDY, attention_backend=backend, **WINDOW_KV_CACHE)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == hf_greedy(path)
    assert core.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="more KV blocks"):
        run_engine(path, GREEDY, free_window_blocks=False, **WINDOW_KV_CACHE)


def test_window_changes_the_answer(model_path: str) -> None:
    """Guards the tests above: without its window the model answers differently on
    prompts longer than it (so a window ignored would fail them)."""
    import json
    import os
    import shutil
    import tempfile

    ref = hf_greedy(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(model_path):
            shutil.copy(os.path.join(model_path, name), tmp)
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["sliding_window"] = 4096
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        tokens, _, _ = run_engine(tmp, GREEDY)
    long_ones = [i for i, p in enumerate(PROMPTS) if len(p) > WINDOW]
    assert sum(tokens[str(i)] != ref[i] for i in long_ones) >= len(long_ones) - 1
    assert len({tuple(r) for r in ref}) == len(ref)  # every prompt its own answer


def test_logprobs_match_hf(model_path: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    tokens, _, lps = run_engine(model_path, params, max_num_batched_tokens=9, block_size=4)
    model = _hf(model_path)
    for i, prompt in enumerate(PROMPTS):
        out = tokens[str(i)]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        for j, entry in enumerate(lps[str(i)]):
            row = ref[len(prompt) - 1 + j]
            for t, lp in entry.items():
                assert lp == pytest.approx(float(row[t]), abs=1e-4), (i, j, t)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "draft_model",
    ],
    ids=["ngram", "draft_model"],
)
def test_speculative_decoding_matches_hf(
    model_path: str, spec: dict[str, Any] | str, tiny_model_factory: Callable[..., str]
) -> None:
    """Drafts verified across the window boundary (rejected drafts' blocks given back in
    both pools); a draft model writes its K/V through the global block table."""
    if spec == "draft_model":
        spec = {"model": tiny_model_factory("llama"), "num_speculative_tokens": 3}
    tokens, core, _ = run_engine(
        model_path, GREEDY, speculative_config=spec, block_size=4, max_num_batched_tokens=16
    )
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == hf_greedy(model_path)
    assert core.scheduler.num_spec_verifications > 0


def test_prefix_cache_hits_across_the_window(model_path: str) -> None:
    tokens, core, _ = run_engine(model_path, GREEDY)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == hf_greedy(model_path)
    assert core.block_manager.num_hit_tokens >= 32  # prompt 5 reused prompt 4's blocks


def test_gemma3_refuses_an_o_proj_bias_under_tensor_parallelism(
    tiny_model_factory: Callable[..., str],
) -> None:
    """Gemma 3 runs under TP/PP (tests/test_parallel.py); only an o_proj bias, which the
    row-parallel projection does not carry, is refused by name."""
    path = tiny_model_factory("gemma3", num_hidden_layers=2, attention_bias=True)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM with attention_bias"):
        EngineCore(*EngineArgs(model=path, tensor_parallel_size=2).resolve())


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_mistral_window_under_parallelism_matches_hf(
    tiny_model_factory: Callable[..., str], kw: dict[str, int]
) -> None:
    """Sharded attention layers keep their window (they did not, once)."""
    path = tiny_model_factory(*MODELS["mistral_window"][:1], **MODELS["mistral_window"][1])
    tokens, core, _ = run_engine(path, GREEDY, **kw)
    core.executor.shutdown()
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == hf_greedy(path)


def _conditional_generation_checkpoint(
    tiny_model_factory: Callable[..., str], out: Path
) -> tuple[str, str]:
    """A Gemma3ForConditionalGeneration folder (vision tower + language model) whose
    language model is a tiny text checkpoint's: (that folder, the text checkpoint)."""
    import json
    import shutil

    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    text_path = tiny_model_factory("gemma3", num_hidden_layers=4, tie_word_embeddings=True)
    text = json.loads((Path(text_path) / "config.json").read_text())
    text.pop("architectures")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=500, boi_token_index=501, eoi_token_index=502,
    )  # fmt: skip
    mm = Gemma3ForConditionalGeneration(cfg)
    state = Gemma3ForCausalLM.from_pretrained(text_path).state_dict()
    lm = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    mm.model.language_model.load_state_dict(lm)
    mm.save_pretrained(out)
    for f in Path(text_path).iterdir():
        if "token" in f.name or f.name == "generation_config.json":
            shutil.copy(f, out)
    return str(out), text_path


def test_gemma3_conditional_generation_checkpoint_serves_its_text_model(
    tiny_model_factory: Callable[..., str], tmp_path: Any
) -> None:
    """The engine reads its text config and language-model tensors and answers as the
    text model does."""
    path, text_path = _conditional_generation_checkpoint(tiny_model_factory, tmp_path)
    tokens, _, _ = run_engine(path, GREEDY)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == hf_greedy(text_path)


@pytest.mark.slow
def test_gemma3_conditional_generation_checkpoint_under_tensor_parallelism(
    tiny_model_factory: Callable[..., str], tmp_path: Any
) -> None:
    """The ranks read their slices under the checkpoint's language-model names (and
    add the norms' 1 as the one-process load does)."""
    path, text_path = _conditional_generation_checkpoint(tiny_model_factory, tmp_path)
    tokens, core, _ = run_engine(path, GREEDY, tensor_parallel_size=2)
    core.executor.shutdown()
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == hf_greedy(text_path)
