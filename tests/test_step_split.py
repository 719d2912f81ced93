"""bench/step_split.py: the per-step split and the head replay, on a tiny model.

The replay itself checks that the LM head computed inside the C step gives exactly the
logits of the same step's hidden states through the module path's `compute_logits`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fleetserve.bench.step_split import read_bandwidth_gbs, split
from fleetserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_split_and_head_replay(arch: str, tiny_model_factory: Callable[..., str]) -> None:
    out = split(tiny_model_factory(arch, tie_word_embeddings=arch == "qwen2"), 1, 16)
    s = out["split"]
    assert s["steps"] == 16 and s["c_step_ms"] > 0 and s["worker_python_ms"] > 0
    assert s["step_ms"] >= s["c_step_ms"] + s["worker_python_ms"]
    replay = out["head_replay"]
    assert replay and all(v > 0 for v in replay.values())


def test_read_bandwidth_is_positive() -> None:
    assert read_bandwidth_gbs(1, megabytes=8) > 0


def test_phases_and_bytes_per_token(tiny_model_factory: Callable[..., str]) -> None:
    out = split(tiny_model_factory("llama"), 1, 16, phases=True)
    ph = out["phases"]
    assert ph["steps"] == 16 and len(ph["total_ms_per_step"]) == 1
    assert all(ph["ms_per_step"][name][0] > 0 for name in ("qkv", "attention", "down", "head"))
    assert set(ph["weight_gbs"]) == {"qkv", "o", "gate_up", "down", "head"}
    assert out["bytes_per_token_mb"] > sum(ph["weight_mb"].values()) * 0.99
