"""bench/offline_split.py: step kinds, their time and a replayed step's parts, on a tiny
model with bf16 weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetserve.bench.offline_split import split
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import native

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or not native(), reason="no C compiler or no native bf16 here"
)


def test_split_counts_every_step_and_replays_both_kinds(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    # Five prompts of 40 tokens under a 64-token budget: prefill, mixed and decode steps.
    reqs = [
        {"prompt_token_ids": [5 + (i * 7 + j) % 90 for j in range(40)], "output_len": 6 + i}
        for i in range(5)
    ]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": reqs}))
    out = split(tiny_model_factory("llama"), str(workload), 1, 64, bf16_weights=True)
    kinds = out["kinds"]
    assert set(kinds) == {"prefill", "mixed", "decode"}
    assert sum(k["rows"] for k in kinds.values()) == 5 * 40 + sum(6 + i for i in range(5)) - 5
    assert all(k["c_step_s"] > 0 and k["runner_python_s"] > 0 for k in kinds.values())
    assert (
        out["total_s"]
        >= sum(k["c_step_s"] + k["runner_python_s"] + k["engine_python_s"] for k in kinds.values())
        * 0.99
    )
    for name in ("mixed", "decode"):
        r = out["replay"][name]
        assert r["step_ms"] > 0 and r["gemm_ms"] > 0 and r["attention_ms"] > 0, r
        assert r["gemm_tflops"] > 0 and "head_ms" in r
    assert out["replay"]["mixed"]["rows"] > out["replay"]["decode"]["rows"] >= 1


def test_split_at_two_threads_reports_the_team(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    # 30 short prompts: decode steps of 30 rows, enough to split by sequences.
    reqs = [
        {"prompt_token_ids": [5 + (i * 7 + j) % 90 for j in range(8)], "output_len": 6}
        for i in range(30)
    ]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": reqs}))
    out = split(tiny_model_factory("llama"), str(workload), 2, 64, bf16_weights=True)
    team = out["team"]
    # Every engine step that ran a C step is counted under its kind, with its worker.
    assert {k: team[k]["steps"] for k in out["kinds"]} == {
        k: v["steps"] for k, v in out["kinds"].items()
    }
    for k in out["kinds"]:
        assert team[k]["worker_cpu_in_c_s"] > 0, team[k]
        assert len(team["timeline"][k]) == min(3, team[k]["steps"])
    # bf16 weights at 2 threads: some steps ran split by sequences, none counted twice.
    kinds = out["kinds"].values()
    assert 0 < sum(k["split_steps"] for k in kinds) <= sum(k["steps"] for k in kinds)
    # One worker beside the main thread; both ran.
    assert sum(t["main"] for t in out["threads_over_run"]) == 1
    assert len(out["threads_over_run"]) >= 2
