"""bench/served_split.py: the served chat workload's steps by kind and rows, with the C
step's phases, on the bundled SmolLM2 GGUF (a few prompts)."""

from __future__ import annotations

import pytest
from tests.helpers import smollm2_path

from fleetserve.bench.served_split import split, table
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import PHASES

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or smollm2_path() is None, reason="no C compiler or no SmolLM2"
)


def test_split_accounts_every_step_and_phase() -> None:
    out = split(smollm2_path(), 1, seed=3, concurrency=2, num_prompts=3)
    groups = out["groups"]
    kinds = [k for k in ("all decode", "all mixed", "all prefill") if k in groups]
    assert "all decode" in kinds and len(kinds) >= 2
    total = groups["all"]
    assert total["steps"] == sum(groups[k]["steps"] for k in kinds)
    assert total["rows"] == sum(groups[k]["rows"] for k in kinds)
    # Every request's prompt is prefilled (less what the prefix cache held) and each output
    # token but the last is fed back as one decode row.
    assert total["rows"] <= out["prompt_tokens"] + out["output_tokens"] - 3
    assert total["rows"] - total["decode_rows"] > 0
    decodes = sum(g["steps"] for name, g in groups.items() if name.startswith("decode "))
    assert decodes == groups["all decode"]["steps"]
    assert all(total[f"{p}_s"] >= 0 for p in PHASES)
    assert total["qkv_s"] > 0 and total["attention_s"] > 0 and total["head_s"] > 0
    assert 0 < total["c_s"] <= out["total_s"]
    assert table(out).count("\n") == len(groups) + 1
