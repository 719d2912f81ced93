"""The C step's opt-in phase timing (DecodePlan.start_profile / stop_profile), which
`python -m fleetserve.bench.step_split --phases` reports: each phase that ran is timed on
each thread, the weight bytes per phase are the projections' own, and timing changes
no token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import PHASES

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def test_profile_times_every_phase(tiny_model_factory: Callable[..., str]) -> None:
    llm = LLM(tiny_model_factory("llama"), quantization="int8", max_model_len=64,
              num_kv_blocks=64, kv_cache_dtype="float32")  # fmt: skip
    runner: Any = llm.engine.core.executor.runner  # type: ignore[attr-defined]
    plan = runner.model.model.decode_plan
    cfg = runner.model.config
    # Q8_0: 34 bytes a block of 32 weights; qkv's rows are q, k and v heads.
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert plan.weight_bytes["qkv"] == cfg.num_hidden_layers * qkv_rows * cfg.hidden_size // 32 * 34
    assert plan.weight_bytes["head"] > 0 and plan.weight_bytes["attention"] == 0
    # Keys and values of every layer per cached position, float32 here.
    kv_heads, layers = cfg.num_key_value_heads, cfg.num_hidden_layers
    assert plan.kv_bytes_per_position == layers * 2 * kv_heads * cfg.head_dim * 4
    prompts = [{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match="no profile"):
        plan.stop_profile()
    plan.start_profile(2)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    secs = plan.stop_profile()
    assert got == want
    assert list(secs) == list(PHASES)
    for name in PHASES:
        assert secs[name][0] > 0, name  # thread 0 runs every phase
    # Off again: the next steps add nothing anywhere.
    llm.generate(prompts, params, use_tqdm=False)
    assert plan._plan.profile is None
    # Each thread's CPU time instead of wall: the same phases, the same tokens.
    plan.start_profile(1, cpu=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    secs = plan.stop_profile()
    assert got == want and all(secs[name][0] > 0 for name in ("qkv", "attention", "head"))
    assert plan._plan.profile_cpu == 1
