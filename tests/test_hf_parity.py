"""Greedy tokens and logprobs match HF transformers on tiny random checkpoints (fp32).

The engine core is driven directly with token ids, under every scheduling setting that
changes how the K/V cache is filled: prefix caching on and off, chunked prefill with a
small budget, a cache too small for all requests at once (preemption and recompute),
and n>1 siblings that share their prompt blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve.core.request import Request
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.core import EngineCore

NUM_TOKENS = 10
MAX_MODEL_LEN = 128


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # Ids 3..511 stay inside every tiny model's vocab (>= 576) and skip special tokens.
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 9, 17, 26)]
    shared = prompts[3][:16]  # 4 full blocks of 4, one of 16
    prompts.append(shared + [7, 8, 9])
    prompts.append(shared + prompts[1])
    prompts.append(prompts[2][:1])  # a prompt of one token
    return prompts


PROMPTS = make_prompts()

# Engine settings: (EngineArgs overrides, whether preemption must happen).
SETTINGS: dict[str, tuple[dict[str, Any], bool]] = {
    "prefix_caching": ({}, False),
    "no_prefix_caching": ({"enable_prefix_caching": False}, False),
    "chunked_prefill": ({"max_num_batched_tokens": 8, "block_size": 4}, False),
    "small_kv_cache": (
        {"num_kv_blocks": 14, "block_size": 4, "max_num_batched_tokens": 16},
        True,
    ),
    "small_kv_cache_no_prefix_caching": (
        {"num_kv_blocks": 14, "block_size": 4, "enable_prefix_caching": False},
        True,
    ),
}

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]

VARIANTS: dict[str, dict[str, Any]] = {
    "mqa": {"num_key_value_heads": 1},
    "head_dim_32": {"head_dim": 32},
    "tied_embeddings": {"tie_word_embeddings": True},
    "rope_llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "rope_linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}


# --------------------------------------------------------------------- reference
_HF_CACHE: dict[str, Any] = {}


def hf_model(path: str) -> Any:
    if path not in _HF_CACHE:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos
        _HF_CACHE[path] = model
    return _HF_CACHE[path]


_GREEDY_CACHE: dict[str, list[list[int]]] = {}


def hf_greedy(path: str) -> list[list[int]]:
    """HF generate's greedy continuation of each prompt, one prompt at a time (no padding)."""
    if path not in _GREEDY_CACHE:
        model = hf_model(path)
        ref = []
        with torch.no_grad():
            for p in PROMPTS:
                out = model.generate(
                    torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0
                )
                ref.append(out[0, len(p) :].tolist())
        assert all(len(r) == NUM_TOKENS for r in ref)
        _GREEDY_CACHE[path] = ref
    return _GREEDY_CACHE[path]


def hf_logprobs(path: str, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position: row j predicts token j + 1."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# ------------------------------------------------------------------------ engine
def run_engine(
    path: str,
    params: SamplingParams,
    n: int = 1,
    prompts: list[list[int]] = PROMPTS,
    **engine_kw: Any,
) -> tuple[dict[str, list[int]], EngineCore, dict[str, dict[str, list]]]:
    """Runs every prompt (n siblings each, as LLMEngine fans them out) to completion,
    checking the block manager after every step. Returns tokens by request id, the core,
    and the logprobs / prompt logprobs by request id."""
    engine_kw.setdefault("max_model_len", MAX_MODEL_LEN)
    config, source = EngineArgs(model=path, **engine_kw).resolve()
    core = EngineCore(config, source)
    tokens: dict[str, list[int]] = {}
    lps: dict[str, dict[str, list]] = {}
    for i, p in enumerate(prompts):
        if i == 4:
            # The later prompts arrive after a step, when the earlier ones' full blocks
            # are cached: prompts 4 and 5 share prompt 3's first 16 tokens.
            run_step(core, tokens, lps)
        for k in range(n):
            rid = f"{i}#{k}" if n > 1 else str(i)
            core.add_request(Request(rid, p, params, group_id=str(i) if n > 1 else None))
            tokens[rid] = []
            lps[rid] = {"logprobs": [], "prompt_logprobs": []}
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        run_step(core, tokens, lps)
    assert not core.has_unfinished_requests()
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return tokens, core, lps


def run_step(
    core: EngineCore, tokens: dict[str, list[int]], lps: dict[str, dict[str, list]]
) -> None:
    for out in core.step():
        tokens[out.req_id] += out.new_token_ids
        if out.new_logprobs is not None:
            lps[out.req_id]["logprobs"] += out.new_logprobs
        if out.new_prompt_logprobs:
            if out.new_prompt_logprobs[0] is None:  # (re)started from position 0
                lps[out.req_id]["prompt_logprobs"] = []
            lps[out.req_id]["prompt_logprobs"] += out.new_prompt_logprobs
    core.block_manager.check_invariants()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def assert_parity(path: str, setting: str, n: int = 1, **extra: Any) -> EngineCore:
    kw, must_preempt = SETTINGS[setting]
    ref = hf_greedy(path)
    tokens, core, _ = run_engine(path, GREEDY, n=n, **kw, **extra)
    for i, expected in enumerate(ref):
        for k in range(n):
            rid = f"{i}#{k}" if n > 1 else str(i)
            assert tokens[rid] == expected, f"prompt {i} (len {len(PROMPTS[i])}) sibling {k}"
    if must_preempt:
        assert core.scheduler.num_preemptions > 0
    if kw.get("enable_prefix_caching", True):
        assert core.block_manager.num_hit_tokens > 0  # the shared prefix was reused
    else:
        assert core.block_manager.num_hit_tokens == 0
    return core


# ------------------------------------------------------------------------- tests
@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory(request.param)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(arch_model: str, setting: str) -> None:
    assert_parity(arch_model, setting)


@pytest.mark.parametrize("setting", ["chunked_prefill", "small_kv_cache"])
def test_torch_attention_backend_matches_hf(arch_model: str, setting: str) -> None:
    # The plain-torch reference backend (the one GPUs run) under the settings that give
    # decodes and prefill chunks with cached context; the default above is the C kernel.
    core = assert_parity(arch_model, setting, n=2, attention_backend="torch")
    assert not core.executor.runner.use_cpu_kernel


def test_default_backend_is_the_cpu_kernel(arch_model: str) -> None:
    from fleetserve.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler here: the plain-torch backend is the default")
    core = assert_parity(arch_model, "prefix_caching")
    assert core.executor.runner.use_cpu_kernel


@pytest.mark.parametrize("setting", ["prefix_caching", "small_kv_cache"])
def test_greedy_siblings_match_hf(arch_model: str, setting: str) -> None:
    assert_parity(arch_model, setting, n=3)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("setting", ["prefix_caching", "small_kv_cache"])
def test_config_variants_match_hf(
    tiny_model_factory: Callable[..., str], variant: str, setting: str
) -> None:
    path = tiny_model_factory("llama", **VARIANTS[variant])
    if variant == "head_dim_32":
        assert hf_model(path).config.head_dim == 32
    assert_parity(path, setting)


def test_qwen3_explicit_head_dim_matches_hf(tiny_model_factory: Callable[..., str]) -> None:
    path = tiny_model_factory("qwen3", head_dim=32, num_key_value_heads=1)
    assert_parity(path, "chunked_prefill")


def test_random_weights_give_distinct_tokens(arch_model: str) -> None:
    """Guards the parity tests: a model that always says the same thing proves little."""
    ref = hf_greedy(arch_model)
    assert len({tuple(r) for r in ref}) == len(ref)  # every prompt its own continuation
    assert all(len(set(r)) > 2 for r in ref)


def _check_entry(entry: dict[int, float], row: torch.Tensor, token: int, k: int) -> None:
    """An entry holds the actual token first, then the top-k; each within 1e-4 of HF."""
    assert next(iter(entry)) == token
    top = set(row.topk(k).indices.tolist())
    assert top <= set(entry) <= top | {token}
    for t, lp in entry.items():
        assert lp == pytest.approx(float(row[t]), abs=1e-4), (t, lp, float(row[t]))


@pytest.mark.parametrize("setting", ["chunked_prefill", "small_kv_cache"])
def test_logprobs_match_hf(arch_model: str, setting: str) -> None:
    check_logprobs_match_hf(arch_model, SETTINGS[setting][0])


def check_logprobs_match_hf(model: str, kw: dict[str, Any]) -> None:
    """Greedy tokens, their top-5 logprobs and the prompt's, engine settings `kw`, against
    HF's float32 forward over prompt + output."""
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    tokens, _, lps = run_engine(model, params, **kw)
    for i, prompt in enumerate(PROMPTS):
        out = tokens[str(i)]
        assert out == hf_greedy(model)[i]
        ref = hf_logprobs(model, prompt + out)
        got = lps[str(i)]
        assert len(got["logprobs"]) == NUM_TOKENS
        for j, entry in enumerate(got["logprobs"]):
            _check_entry(entry, ref[len(prompt) - 1 + j], out[j], 5)
        prompt_lps = got["prompt_logprobs"]
        assert len(prompt_lps) == len(prompt)
        assert prompt_lps[0] is None
        for j in range(1, len(prompt)):
            _check_entry(prompt_lps[j], ref[j - 1], prompt[j], 5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_random_engine_settings_match_hf(tiny_model_factory: Callable[..., str], arch: str) -> None:
    """A sweep over block sizes, cache sizes (down to the minimum one request needs),
    token budgets down to 1, max_num_seqs and n: greedy always matches HF, and seeded
    sampling with penalties gives the same tokens and logprobs as a roomy run."""
    import random

    path = tiny_model_factory(arch)
    ref = hf_greedy(path)
    seeded = SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.9,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        seed=5,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
        min_tokens=3,
        logprobs=2,
    )
    seeded_ref, _, seeded_lps = run_engine(path, seeded)
    rng = random.Random(arch)
    for _ in range(12):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        need = max(-(-(len(p) + NUM_TOKENS) // bs) for p in PROMPTS)
        kw = dict(
            block_size=bs,
            num_kv_blocks=rng.randint(need, 3 * need),
            max_num_batched_tokens=rng.randint(1, 40),
            max_num_seqs=rng.randint(1, 8),
            enable_prefix_caching=rng.random() < 0.6,
        )
        n = rng.choice([1, 1, 2])
        tokens, _, _ = run_engine(path, GREEDY, n=n, **kw)
        for rid, toks in tokens.items():
            assert toks == ref[int(rid.split("#")[0])], (kw, rid)
        tokens, _, lps = run_engine(path, seeded, **kw)
        assert tokens == seeded_ref, kw
        for rid in tokens:
            for got, want in zip(lps[rid]["logprobs"], seeded_lps[rid]["logprobs"], strict=True):
                assert got.keys() == want.keys()
                assert all(abs(got[t] - want[t]) < 1e-4 for t in got), kw


@pytest.mark.parametrize("group_size", [1, 2])
def test_decode_groups_match_hf(
    arch_model: str, group_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decodes are attended in length-sorted groups; tiny groups make every batch of
    # prompts span several groups with different padded lengths.
    import fleetserve.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "DECODE_GROUP_SIZE", group_size)
    assert_parity(arch_model, "prefix_caching", n=2, attention_backend="torch")
