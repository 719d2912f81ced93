"""`fleetserve bench batch --compare vllm`: option checks, command, env and the subprocess
handling, with a fake interpreter standing in for vLLM's (vLLM itself is not needed)."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import torch

from fleetserve.bench import batch_vllm
from fleetserve.entrypoints import cli
from helpers import write_tiny_gguf


def _settings(python: str, threads: int = 2, timeout_s: float = 60.0) -> batch_vllm.VllmSettings:
    return batch_vllm.VllmSettings(
        python=python,
        model_dir="/models/smol",
        max_tokens_per_step=2048,
        max_num_seqs=64,
        max_model_len=2048,
        num_threads=threads,
        kvcache_gib=3,
        timeout_s=timeout_s,
    )


def _fake_python(tmp_path, body: str) -> str:
    """An executable that takes run_batch's arguments; `body` is bash run with them."""
    path = tmp_path / "python"
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_compare_vllm_without_vllm_python_is_refused_by_the_cli(capsys):
    rc = cli.main(["bench", "batch", "--compare", "vllm", "--num-lines", "3"])
    assert rc == 2
    assert "--compare vllm needs --vllm-python" in capsys.readouterr().err


def test_check_compare_args(tmp_path):
    batch_vllm.check_compare_args(None, None)  # no comparison: nothing to check
    with pytest.raises(ValueError, match="--vllm-python"):
        batch_vllm.check_compare_args("vllm", "")
    with pytest.raises(ValueError, match="not an executable file"):
        batch_vllm.check_compare_args("vllm", str(tmp_path / "missing"))
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(ValueError, match="not an executable file"):
        batch_vllm.check_compare_args("vllm", str(plain))
    with pytest.raises(ValueError, match="--compare"):
        batch_vllm.check_compare_args("sglang", str(plain))
    batch_vllm.check_compare_args("vllm", _fake_python(tmp_path, "exit 0"))


def test_command_and_env_carry_fleetserve_engine_settings():
    s = _settings("/venv/bin/python")
    cmd = batch_vllm.vllm_command(s, "/t/in.jsonl", "/t/out.jsonl")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.run_batch"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["-i"] == "/t/in.jsonl" and flags["-o"] == "/t/out.jsonl"
    assert flags["--model"] == "/models/smol"
    assert flags["--dtype"] == "float32"
    assert flags["--max-num-seqs"] == "64"
    assert flags["--max-num-batched-tokens"] == "2048"
    assert flags["--max-model-len"] == "2048"
    assert "--enable-prefix-caching" in cmd

    base = {"PATH": "/usr/bin", "PYTHONPATH": "/work/src", "HOME": "/root"}
    env = batch_vllm.vllm_env(s, "/t/cache", base)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_CACHE_ROOT"] == "/t/cache"
    assert "PYTHONPATH" not in env and env["PATH"] == "/usr/bin"
    assert base["PYTHONPATH"] == "/work/src"  # the caller's dict is left alone
    one = batch_vllm.vllm_env(_settings("/p", threads=1), "/c", {})
    assert one["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_run_vllm_times_start_up_and_reads_the_output(tmp_path):
    # Writes two result lines and one error line to -o, as run_batch does, after a
    # "Reading batch from" log line that marks the end of start-up.
    python = _fake_python(
        tmp_path,
        """out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
sleep 0.5; echo "INFO Reading batch from in.jsonl..."; sleep 0.3
echo '{"custom_id": "line-0", "response": {"status_code": 200, "body": {"choices":
 [{"message": {"content": "Red."}}], "usage": {"completion_tokens": 3}}}, "error": null}' \
  | tr -d '\\n' > "$out"; echo >> "$out"
echo '{"custom_id": "line-1", "response": {"status_code": 200, "body": {"choices":
 [{"message": {"content": "Mars"}}], "usage": {"completion_tokens": 2}}}, "error": null}' \
  | tr -d '\\n' >> "$out"; echo >> "$out"
echo '{"custom_id": "line-2", "response": null, "error": {"message": "bad"}}' >> "$out"
[ "$VLLM_CACHE_ROOT" = "$CHECK_CACHE" ] || exit 3""",
    )
    out = str(tmp_path / "out.jsonl")
    cache = str(tmp_path / "cache")
    os.environ["CHECK_CACHE"] = cache
    try:
        timing = batch_vllm.run_vllm(_settings(python), "in.jsonl", out, cache)
    finally:
        del os.environ["CHECK_CACHE"]
    assert 0.4 < timing["startup_s"] < timing["wall_s"]
    rows = batch_vllm.read_vllm_output(out)
    assert rows == {
        "line-0": {"text": "Red.", "tokens": 3},
        "line-1": {"text": "Mars", "tokens": 2},
        "line-2": {"text": None, "tokens": 0},
    }


def test_run_vllm_failure_and_timeout(tmp_path):
    failing = _fake_python(tmp_path, 'echo "no module named vllm" >&2; exit 1')
    with pytest.raises(RuntimeError, match="exited 1:\nno module named vllm"):
        batch_vllm.run_vllm(_settings(failing), "i", str(tmp_path / "o"), str(tmp_path))
    # A hung run is killed at the timeout, its children with it (its own process group).
    pid_file = tmp_path / "child.pid"
    hung = tmp_path / "hung"
    hung.mkdir()
    python = _fake_python(hung, f"sleep 300 & echo $! > {pid_file}; wait")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="ran past 1 s"):
        batch_vllm.run_vllm(_settings(python, timeout_s=1.0), "i", "o", str(tmp_path))
    assert time.perf_counter() - t0 < 10
    child = int(pid_file.read_text())
    for _ in range(50):
        if not os.path.exists(f"/proc/{child}") or "Z" in _proc_state(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the hung run's child survived the timeout")


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_export_hf_folder_matches_transformers_gguf_loader(tiny_model_factory, tmp_path):
    """The dequantized folder vLLM is given holds what transformers reads from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_factory("llama"), gguf_path)
    folder = batch_vllm.export_hf_folder(gguf_path, str(tmp_path / "hf"))
    assert batch_vllm.export_hf_folder(folder, "/unused") == folder  # a folder is used as is
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    )
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, reference(ids).logits, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(folder)
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    text = "the old sailor found a red box"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == ref_tok.apply_chat_template(
        messages, tokenize=False
    )
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
