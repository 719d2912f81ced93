"""A bf16 KV cache (`kv_cache_dtype`; "auto" picks it for a model with bf16 weights, as HF's
bf16 model keeps its cache in bf16): written rounded to nearest even (the C step's K/V
store and the module path's cache_write alike), read by the paged-attention kernel widened
to float32 in registers. Checked here: the dtype choice and its refusals, the C step
against the module path over a bf16 cache (bit-equal tokens, as with float32), greedy
tokens against HF transformers in bfloat16 with prefix hits, chunked prefill and
preemption, and the torch backend reading a bf16 cache. The kernel itself against dense
attention at both cache dtypes is tests/test_attention_kernel.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fleetserve import LLM
from fleetserve.config import CacheConfig
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.kernels import cpu as cpu_kernels
from test_fused_decode import _assert_same, _generate, _on_and_off, _prompts, _runner
from test_hf_parity import PROMPTS, SETTINGS, run_engine

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

NUM_TOKENS = 8


def _kv_dtypes(llm: LLM) -> set[torch.dtype]:
    return {t.dtype for pair in _runner(llm).kv_caches for t in pair}


def test_auto_is_the_compute_dtype(tiny_model_factory: Callable[..., str]) -> None:
    """bf16 weights -> bf16 cache, twice the blocks in the same memory; float32 weights
    keep float32; either may be asked for explicitly."""
    path = tiny_model_factory("llama")
    kw: dict[str, Any] = dict(max_model_len=64, block_size=4, kv_cache_memory=1 << 20)
    bf, _ = EngineArgs(model=path, bf16_weights=True, **kw).resolve()
    fp, _ = EngineArgs(model=path, **kw).resolve()
    forced, _ = EngineArgs(model=path, bf16_weights=True, kv_cache_dtype="float32", **kw).resolve()
    asked, _ = EngineArgs(model=path, kv_cache_dtype="bfloat16", **kw).resolve()
    assert (bf.kv_dtype, fp.kv_dtype) == (torch.bfloat16, torch.float32)
    assert (forced.kv_dtype, asked.kv_dtype) == (torch.float32, torch.bfloat16)
    blocks = [c.cache.resolve_num_blocks(c.model, 1, c.kv_dtype) for c in (bf, fp)]
    assert blocks[0] == 2 * blocks[1]
    llm = LLM(path, bf16_weights=True, **kw)
    assert _kv_dtypes(llm) == {torch.bfloat16}
    assert _runner(llm).model.model.decode_plan is not None  # the C step takes bf16 caches
    assert _kv_dtypes(LLM(path, **kw)) == {torch.float32}


@pytest.mark.parametrize("bad", ["float16", "fp8", "", "BF16"])
def test_bad_value_is_refused_naming_the_field(
    bad: str, tiny_model_factory: Callable[..., str]
) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model=tiny_model_factory("llama"), kv_cache_dtype=bad).resolve()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_c_step_and_module_path_same_tokens(
    arch: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks mixed with decodes, a second wave on cached prefixes: the C step
    (its own K/V store) and the module path (cache_write) over one bf16 cache give the
    same tokens, logprobs within 1e-5 (bit-equal in practice)."""
    llm = LLM(
        tiny_model_factory(arch), bf16_weights=True, max_model_len=160, block_size=4,
        num_kv_blocks=320, max_num_batched_tokens=24,
    )  # fmt: skip
    assert _kv_dtypes(llm) == {torch.bfloat16}
    prompts = _prompts(10, 500, seed=8, step=5)
    on, off, counted = _on_and_off(llm, prompts, 8, monkeypatch, waves=2)
    _assert_same(on, off)
    assert counted.mixed > 0 and counted.multi_row_with_context > 0


_HF_BF16: dict[str, list[list[int]]] = {}


def _hf_bf16_greedy(path: str) -> list[list[int]]:
    if path not in _HF_BF16:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.inference_mode():
            _HF_BF16[path] = [
                model.generate(
                    torch.tensor([p]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                    do_sample=False, pad_token_id=0,
                )[0, len(p) :].tolist()
                for p in PROMPTS
            ]  # fmt: skip
    return _HF_BF16[path]


NEAR_TIE = 0.15  # nats


@pytest.mark.parametrize("setting", ["prefix_caching", "chunked_prefill", "small_kv_cache"])
def test_greedy_matches_hf_bf16(setting: str, tiny_model_factory: Callable[..., str]) -> None:
    """Prefix hits (prompts sharing 16 tokens), chunked prefill and preemption with
    recompute over a bf16 cache: HF bfloat16's greedy tokens (HF keeps its cache in bf16
    too), up to a near tie. HF rounds every activation to bf16 and fleetserve only the
    weights, GEMM inputs and the cache, so on these random tiny models two tokens within
    a few hundredths of a nat can swap (measured: 0.04 nats at the one swap, with a
    float32 cache as with a bf16 one); a run may leave HF's path only there, where HF's
    token is within NEAR_TIE of ours."""
    path = tiny_model_factory("llama")
    kw, must_preempt = SETTINGS[setting]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    tokens, core, lps = run_engine(path, params, prompts=PROMPTS, bf16_weights=True, **kw)
    runner = core.executor.runner  # type: ignore[attr-defined]
    assert {t.dtype for pair in runner.kv_caches for t in pair} == {torch.bfloat16}
    exact = 0
    for i, want in enumerate(_hf_bf16_greedy(path)):
        got = tokens[str(i)]
        if got == want:
            exact += 1
            continue
        j = next(k for k in range(NUM_TOKENS) if got[k] != want[k])
        row = lps[str(i)]["logprobs"][j]
        assert want[j] in row and row[got[j]] - row[want[j]] < NEAR_TIE, (i, j, row)
    assert exact >= len(PROMPTS) - 1
    if must_preempt:
        assert core.scheduler.num_preemptions > 0
    assert core.block_manager.num_hit_tokens > 0


def test_torch_backend_reads_a_bf16_cache(tiny_model_factory: Callable[..., str]) -> None:
    """The plain-torch backend (float32 model) over a bf16 cache widens what it gathers:
    the same tokens as the C kernel over the same bf16 cache."""
    path = tiny_model_factory("llama")
    kw: dict[str, Any] = dict(
        max_model_len=96, block_size=4, num_kv_blocks=128, kv_cache_dtype="bfloat16"
    )
    prompts = _prompts(4, 500, seed=9, step=7)
    torch_llm = LLM(path, attention_backend="torch", **kw)
    assert _kv_dtypes(torch_llm) == {torch.bfloat16}
    kernel_llm = LLM(path, **kw)
    assert _kv_dtypes(kernel_llm) == {torch.bfloat16}
    a, b = _generate(torch_llm, prompts, NUM_TOKENS), _generate(kernel_llm, prompts, NUM_TOKENS)
    for (ta, lpa), (tb, lpb) in zip(a, b, strict=True):
        assert ta == tb
        for ra, rb in zip(lpa, lpb, strict=True):
            for tok in ra.keys() & rb.keys():
                assert abs(ra[tok] - rb[tok]) < 1e-3


def test_flag_and_fleet_file(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """`--kv-cache-dtype` reaches EngineArgs; a fleet file's `engine:` takes the field; next
    to --config the flag is refused, as every model flag is."""
    import argparse

    from fleetserve.entrypoints.cli import main
    from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from
    from fleetserve.serve.config.fleet_config import parse_fleet_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["--kv-cache-dtype", "bfloat16"])).kv_cache_dtype == (
        "bfloat16"
    )
    assert engine_args_from(p.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "float16"])
    cfg = parse_fleet_config({"models": [{"name": "m", "engine": {"kv_cache_dtype": "float32"}}]})
    assert cfg.models[0].engine_args().kv_cache_dtype == "float32"
    good = tmp_path / "good.yaml"
    good.write_text("models:\n  - name: chat\n")
    capsys.readouterr()
    assert main(["serve", "--config", str(good), "--kv-cache-dtype", "bfloat16"]) == 2
    assert "leave out --kv-cache-dtype" in capsys.readouterr().err
