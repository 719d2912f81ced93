"""MoE models under tensor parallelism and expert parallelism match one process exactly.

Plain TP slices every expert; `expert_parallel` gives each rank whole experts of its own
(models/moe_sharding.py). Both run test_parallel's workload (chunked prefill, a shared
prefix, preemption, logprobs, a seeded sample) and must give the single process's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from fleetserve import LLM
from fleetserve.config import ModelConfig, ParallelConfig
from fleetserve.distributed.parallel_state import ParallelContext
from fleetserve.models.loader import resolve_model
from fleetserve.models.moe import MoeForCausalLM, SparseMoeBlock
from fleetserve.models.sharding import check_parallel_config, shard_model
from test_parallel import ENGINE_ARGS, assert_gone, assert_same_outputs, run_workload, worker_pids

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel_size": 2},
    "tp2_ep": {"tensor_parallel_size": 2, "expert_parallel": True},
}
_REFERENCE: dict[str, list[Any]] = {}


def reference(path: str) -> list[Any]:
    if path not in _REFERENCE:
        llm = LLM(path, **ENGINE_ARGS)
        _REFERENCE[path] = run_workload(llm)
        assert llm.engine.core.scheduler.num_preemptions > 0, "the workload must preempt"
        llm.engine.shutdown()
    return _REFERENCE[path]


CASES = [
    pytest.param(
        arch,
        layout,
        id=f"{arch}-{layout}",
        # Qwen3-MoE's plain TP adds nothing the other two do not cover: the slow stage.
        marks=[pytest.mark.slow] if (arch, layout) == ("qwen3_moe", "tp2") else [],
    )
    for arch in ("mixtral", "qwen2_moe", "qwen3_moe")
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_moe_parallel_matches_single_process(
    arch: str, layout: str, tiny_model_factory: Callable[..., str]
) -> None:
    path = tiny_model_factory(arch)
    want = reference(path)
    llm = LLM(path, **LAYOUTS[layout], **ENGINE_ARGS)
    pids = worker_pids(llm)
    try:
        assert_same_outputs(run_workload(llm), want)
    finally:
        llm.engine.shutdown()
    assert_gone(pids)


@pytest.mark.slow
def test_moe_expert_parallel_with_pipeline_matches(tiny_model_factory: Callable[..., str]) -> None:
    path = tiny_model_factory("qwen2_moe")
    llm = LLM(
        path, tensor_parallel_size=2, pipeline_parallel_size=2, expert_parallel=True, **ENGINE_ARGS
    )
    try:
        assert_same_outputs(run_workload(llm), reference(path))
    finally:
        llm.engine.shutdown()


def _sharded(path: str, rank: int, expert_parallel: bool) -> MoeForCausalLM:
    cfg = ModelConfig.from_hf(resolve_model(path).hf_config)
    ctx = ParallelContext(rank, 2, 0, 1, expert_parallel=expert_parallel)
    with torch.device("meta"):
        model = MoeForCausalLM(cfg)
        shard_model(model, ctx)
    return model


def test_expert_parallel_holds_whole_experts(tiny_model_factory: Callable[..., str]) -> None:
    path = tiny_model_factory("qwen2_moe")  # 4 experts of 64, a shared expert of 96
    for rank in (0, 1):
        block = _sharded(path, rank, expert_parallel=True).model.layers[0].mlp
        assert isinstance(block, SparseMoeBlock)
        assert (block.experts.first_expert, block.experts.num_local) == (2 * rank, 2)
        assert tuple(block.experts.gate_up_proj.shape) == (2, 128, 64)
        assert block.shared_expert is not None
        assert block.shared_expert.intermediate_size == 48  # the dense part stays TP
    block = _sharded(path, 1, expert_parallel=False).model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    assert (block.experts.first_expert, block.experts.num_local) == (0, 4)
    assert tuple(block.experts.down_proj.shape) == (4, 64, 32)  # every expert, half of it


def test_expert_parallel_refusals(tiny_model_factory: Callable[..., str]) -> None:
    moe = ModelConfig.from_hf(resolve_model(tiny_model_factory("qwen3_moe")).hf_config)
    assert moe.moe is not None
    six = replace(moe, moe=replace(moe.moe, num_experts=6))
    with pytest.raises(ValueError, match="must divide num_experts=6"):
        check_parallel_config(six, ParallelConfig(tensor_parallel_size=4, expert_parallel=True))
    # Plain TP of the same model is fine: it slices experts of 32 rows in 4.
    check_parallel_config(six, ParallelConfig(tensor_parallel_size=4))
    dense = ModelConfig.from_hf(resolve_model(tiny_model_factory("llama")).hf_config)
    with pytest.raises(ValueError, match="expert_parallel needs a mixture-of-experts"):
        check_parallel_config(dense, ParallelConfig(tensor_parallel_size=2, expert_parallel=True))
    with pytest.raises(ValueError, match="expert_parallel needs tensor_parallel_size >= 2"):
        ParallelConfig(expert_parallel=True)
