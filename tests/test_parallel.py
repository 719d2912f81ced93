"""Tensor and pipeline parallelism give the same tokens as one process, and fail loudly.

Each parallel engine is a set of spawned worker processes (a few seconds to start on two
cores), so one engine runs the whole workload: prompts of many lengths with a shared
prefix, chunked prefill, a KV cache small enough to force preemption, logprobs and
prompt logprobs, and one seeded sampled request. The single-process engine on the same
settings is the reference. The architecture variants cover what sharding can get wrong:
fewer KV heads than ranks (MQA, replicated), head_dim != hidden / heads, tied embeddings,
a vocabulary that does not split evenly, q/k/v biases and q/k norms, Gemma 3's layers.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.core.block_manager import BlockManager
from fleetserve.core.config import SchedulerConfig
from fleetserve.core.request import Request
from fleetserve.core.scheduler import Scheduler
from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fleetserve.executor.base import ModelOutputFuture
from fleetserve.executor.uniproc import UniprocExecutor

ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 128,
    "block_size": 4,
    "max_num_batched_tokens": 32,  # prompts are prefilled in chunks
    "num_kv_blocks": 24,  # fewer than the workload needs at once: preemption
}

# name -> (arch, make_model overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # 4 heads, 2 KV heads: one KV head per rank at TP=2
    "mistral_mqa_odd_vocab": ("mistral", {"num_key_value_heads": 1, "vocab_size": 643}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3_head_dim_32": ("qwen3", {"head_dim": 32}),  # hidden 64 / 4 heads would be 16
    # Gemma 3: sandwich norms (1 + w added at load), GeGLU, embedding scale (first stage
    # only), local layers with a 16-token window and their own RoPE base; tied head.
    "gemma3": ("gemma3", {"num_hidden_layers": 4}),
}
# Gemma's local layers free the blocks that slide out of their window: at 24 blocks the
# shared prefix's are gone before it is reused; at 32 the workload both hits and preempts.
ENGINE_OVERRIDES: dict[str, dict[str, Any]] = {"gemma3": {"num_kv_blocks": 32}}


def engine_args(name: str) -> dict[str, Any]:
    return {**ENGINE_ARGS, **ENGINE_OVERRIDES.get(name, {})}


def make_workload() -> tuple[list[dict[str, list[int]]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 9, 17, 26, 40)]
    shared = prompts[3][:16]
    prompts += [shared + [7, 8, 9], shared + prompts[1], prompts[2][:1]]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    params[4] = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    return [{"prompt_token_ids": p} for p in prompts], params


def run_workload(llm: LLM) -> list[Any]:
    prompts, params = make_workload()
    return llm.generate(prompts, params, use_tqdm=False)


def assert_same_outputs(got: list[Any], want: list[Any]) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        for g_lp, w_lp in zip(
            g.outputs[0].logprobs or [], w.outputs[0].logprobs or [], strict=True
        ):
            assert g_lp.keys() == w_lp.keys()
            for tok in w_lp:
                assert g_lp[tok] == pytest.approx(w_lp[tok], abs=1e-4)
        for g_lp, w_lp in zip(g.prompt_logprobs or [], w.prompt_logprobs or [], strict=True):
            assert (g_lp is None) == (w_lp is None)
            if w_lp is not None:
                assert g_lp.keys() == w_lp.keys()
                for tok in w_lp:
                    assert g_lp[tok] == pytest.approx(w_lp[tok], abs=1e-4)
    assert got[1].prompt_logprobs is not None and got[1].outputs[0].logprobs


_REFERENCE: dict[str, list[Any]] = {}


@pytest.fixture(scope="module")
def model_path(tiny_model_factory: Callable[..., str]) -> Callable[[str], str]:
    def path(name: str) -> str:
        arch, overrides = MODELS[name]
        return tiny_model_factory(arch, **overrides)

    return path


def reference(name: str, path: str) -> list[Any]:
    if name not in _REFERENCE:
        llm = LLM(path, **engine_args(name))
        _REFERENCE[name] = run_workload(llm)
        assert llm.engine.core.scheduler.num_preemptions > 0, "the workload must preempt"
        llm.engine.shutdown()
    return _REFERENCE[name]


def worker_pids(llm: LLM) -> list[int]:
    return llm.engine.core.executor.worker_pids


def assert_gone(pids: list[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker processes still alive: {alive}")


# --------------------------------------------------------------- token exactness
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2_pp2": (2, 2)}
CASES = [
    pytest.param(
        name,
        layout,
        id=f"{name}-{layout}",
        marks=[pytest.mark.slow] if layout == "tp2_pp2" and name != "llama" else [],
    )
    for name in MODELS
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_parallel_matches_single_process(
    name: str, layout: str, model_path: Callable[[str], str]
) -> None:
    path = model_path(name)
    want = reference(name, path)
    tp, pp = LAYOUTS[layout]
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine_args(name))
    pids = worker_pids(llm)
    assert len(pids) == tp * pp
    try:
        assert_same_outputs(run_workload(llm), want)
        assert llm.engine.core.block_manager.num_hit_tokens > 0  # the shared prefix
        # Every rank ran every forward through its C step (kernels/decode_step.c: its
        # shard, the all-reduces called back from inside), the last stage's ranks their
        # vocab shard of the LM head too.
        assert_c_step_on_every_rank(llm, tp, pp)
    finally:
        llm.engine.shutdown()
    assert_gone(pids)


def assert_c_step_on_every_rank(llm: LLM, tp: int, pp: int) -> None:
    for rank in llm.engine.core.executor.collect_stats():
        assert rank["forward_steps"] > 0, rank
        assert rank["c_steps"] == rank["forward_steps"], rank
        last_stage = rank["rank"] >= tp * (pp - 1)
        assert (rank["c_head_steps"] > 0) == last_stage, rank


def test_tp_ranks_with_thread_teams_match_single_process(
    model_path: Callable[[str], str],
) -> None:
    """Two threads per rank: the all-reduce is called back from the C step's master
    thread while the other waits at the team's barrier."""
    want = reference("llama", model_path("llama"))
    llm = LLM(model_path("llama"), tensor_parallel_size=2, num_threads=4, **engine_args("llama"))
    try:
        assert_same_outputs(run_workload(llm), want)
        assert_c_step_on_every_rank(llm, 2, 1)
    finally:
        llm.engine.shutdown()


# ------------------------------------------ pipelined stepping, in one process
def test_scheduler_spreads_requests_over_in_flight_batches() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), bm)
    for rid in "abcd":
        sched.add_request(Request(rid, [3, 4, 5], SamplingParams(max_tokens=4)))
    first = sched.schedule(max_num_reqs=2)
    assert first.num_scheduled_tokens == {"a": 3, "b": 3}
    second = sched.schedule(skip_req_ids={"a", "b"}, max_num_reqs=2)
    assert second.num_scheduled_tokens == {"c": 3, "d": 3}
    assert sched.schedule(skip_req_ids={"a", "b", "c", "d"}).is_empty
    sched.update_from_output(first, ModelRunnerOutput(["a", "b"], [[7], [8]]))
    third = sched.schedule(skip_req_ids={"c", "d"}, max_num_reqs=2)
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [c.new_token_ids for c in third.scheduled_cached_reqs] == [[7], [8]]


class _Deferred(ModelOutputFuture):
    def __init__(self, executor: DeferredExecutor, so: SchedulerOutput) -> None:
        self.executor, self.so = executor, so

    def result(self) -> Any:
        # Runs only when the engine takes the result, in submission order.
        assert self.executor.in_flight[0] is self
        self.executor.in_flight.pop(0)
        return self.executor.execute_model(self.so)


class DeferredExecutor(UniprocExecutor):
    """A PP=2 stand-in: steps are queued and run when their result is taken."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.in_flight: list[_Deferred] = []
        self.max_seen = 0

    @property
    def max_concurrent_batches(self) -> int:
        return 2

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelOutputFuture:
        busy = {r for f in self.in_flight for r in f.so.num_scheduled_tokens}
        assert not busy & scheduler_output.num_scheduled_tokens.keys(), "request in 2 batches"
        future = _Deferred(self, scheduler_output)
        self.in_flight.append(future)
        self.max_seen = max(self.max_seen, len(self.in_flight))
        return future


@pytest.mark.parametrize("name", list(MODELS))
def test_pipelined_steps_match_single_process(
    name: str, model_path: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = model_path(name)
    want = reference(name, path)
    monkeypatch.setattr("fleetserve.engine.core.make_executor", DeferredExecutor)
    llm = LLM(path, **ENGINE_ARGS)
    assert_same_outputs(run_workload(llm), want)
    executor = llm.engine.core.executor
    assert executor.max_seen == 2 and not executor.in_flight
    assert llm.engine.core.scheduler.num_preemptions > 0


# ------------------------------------------------------------------- failures
def test_unsplittable_model_is_refused(model_path: Callable[[str], str]) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention"):
        LLM(model_path("llama"), tensor_parallel_size=3, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must be at most"):
        LLM(model_path("llama"), pipeline_parallel_size=3, **ENGINE_ARGS)


@pytest.mark.parametrize(
    ("layout", "victim"),
    [
        pytest.param((2, 1), 1, id="tp2-kill-rank1"),
        pytest.param((1, 2), 0, id="pp2-kill-stage0", marks=pytest.mark.slow),
    ],
)
def test_dead_worker_fails_fast_and_leaves_no_process(
    layout: tuple[int, int], victim: int, model_path: Callable[[str], str]
) -> None:
    tp, pp = layout
    llm = LLM(
        model_path("llama"), tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=128
    )
    engine = llm.engine
    pids = worker_pids(llm)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": [5 + i, 6, 7]}, params)
    for _ in range(5):
        engine.step()
    os.kill(pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"worker rank {victim} .*died"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 5.0
    assert_gone(pids)
    with pytest.raises(RuntimeError, match=f"worker rank {victim}"):
        engine.step()  # stays failed
    engine.shutdown()


def test_garbage_collected_engine_stops_its_workers(model_path: Callable[[str], str]) -> None:
    llm = LLM(model_path("llama"), tensor_parallel_size=2, max_model_len=128)
    pids = worker_pids(llm)
    assert all(psutil.pid_exists(p) for p in pids)
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    assert set(pids) <= children
    del llm
    gc.collect()
    assert_gone(pids)
