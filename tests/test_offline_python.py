"""bench/offline_python.py: the engine thread's Python outside the C step, by part, with
the real step and with its stand-in (the same steps either way)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetserve.bench.offline_python import beside, measure
from fleetserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def test_parts_add_up_and_the_stub_runs_the_same_steps(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    reqs = [
        {"prompt_token_ids": [5 + (i * 7 + j) % 90 for j in range(30)], "output_len": 4 + i}
        for i in range(4)
    ]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": reqs}))
    model = tiny_model_factory("llama")
    real = measure(model, str(workload), 1)
    stub = measure(model, str(workload), 1, stub=True, reps=2)
    # One prefill step for the 4 prompts, then one decode step per token after the first.
    assert real["steps"] == stub["steps"] == 1 + max(4 + i for i in range(4)) - 1
    for out in (real, stub):
        parts = out["parts_ms"]
        assert out["python_ms"] > 0 and parts["schedule"] > 0 and parts["output_processor"] > 0
        assert parts["runner_metadata"] > 0 and parts["runner_sample"] > 0
        assert sum(parts.values()) == pytest.approx(out["python_ms"], rel=0.02, abs=0.5)
    assert real["c_step_ms"] > 0 and stub["c_step_ms"] is None


def test_beside_times_a_64_row_decode_step_both_ways(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    reqs = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i % 50], "output_len": 3} for i in range(64)]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": reqs}))
    out = beside(tiny_model_factory("llama"), str(workload), 1, 0.2, 3)
    assert out["alone_ms"] > 0 and out["beside_ms"] > 0 and out["work_ms"] == 0.2
    workload.write_text(json.dumps({"requests": reqs[:63]}))
    with pytest.raises(ValueError, match="64-row"):
        beside(tiny_model_factory("llama"), str(workload), 1, 0.2, 1)
