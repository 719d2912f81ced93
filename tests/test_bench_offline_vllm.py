"""`fleetserve bench offline --compare vllm`: the refusal without vLLM's venv, the job and
command it builds, and the run end to end with a stand-in for vLLM's interpreter that
checks what it is given and answers as the runner would (vLLM itself is not needed)."""

from __future__ import annotations

import argparse
import json
import stat
import sys

import pytest

from fleetserve.bench import offline, offline_vllm
from fleetserve.bench.workloads import BenchRequest
from fleetserve.entrypoints.cli import main


def _args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    offline.add_cli_args(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_missing_vllm_venv_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLEETSERVE_VLLM_PYTHON", raising=False)
    assert main(["bench", "offline", "--compare", "vllm"]) == 2
    assert "--compare vllm needs --vllm-python" in capsys.readouterr().err
    argv = ["bench", "offline", "--compare", "vllm", "--vllm-python", str(tmp_path / "py")]
    assert main(argv) == 2
    assert "not an executable file" in capsys.readouterr().err


def test_vllm_python_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLEETSERVE_VLLM_PYTHON", "/venvs/vllm/bin/python")
    assert _args().vllm_python == "/venvs/vllm/bin/python"


def test_job_and_command_default_to_vllms_own_dtype():
    reqs = [BenchRequest([5, 6, 7], 4), BenchRequest([8, 9], 2)]
    args = _args(max_num_seqs=8)
    job = offline_vllm.vllm_job("/m", reqs, args, max_model_len=32, result_path="/t/r.json")
    assert job["dtype"] == "auto"  # vLLM picks: bfloat16 on a CPU with AVX512-BF16
    assert job["max_num_seqs"] == 8 and job["max_model_len"] == 32
    assert job["prefix_caching"] is True  # as fleetserve's own run
    assert job["requests"][1] == {"prompt_token_ids": [8, 9], "output_len": 2}
    assert job["result_path"] == "/t/r.json"
    forced = offline_vllm.vllm_job("/m", reqs, _args(vllm_dtype="float32"), 32, "/t/r.json")
    assert forced["dtype"] == "float32"
    cmd = offline_vllm.vllm_offline_command("/venv/bin/python", "/tmp/job.json")
    assert cmd == ["/venv/bin/python", str(offline_vllm.RUNNER), "/tmp/job.json"]
    assert offline_vllm.RUNNER.is_file()


def test_compare_vllm_end_to_end_with_a_stand_in(tiny_llama, tmp_path, capsys):
    wl = tmp_path / "wl.json"
    reqs = [{"prompt_token_ids": [5 + i, 6, 7, 8], "output_len": 3 + i} for i in range(3)]
    wl.write_text(json.dumps({"requests": reqs}))
    # Answers with each request's output_len zeros after checking the runner, the job and
    # the environment it was given (one OpenMP thread per core, fleetserve's path dropped);
    # logs before and after its result, as vLLM's shutting-down processes do.
    fake = tmp_path / "fake_runner.py"
    fake.write_text(
        "import json, os, sys\n"
        "assert sys.argv[1].endswith('vllm_offline_runner.py'), sys.argv\n"
        "assert os.environ['VLLM_CPU_OMP_THREADS_BIND'] == '0-1'\n"
        "assert 'PYTHONPATH' not in os.environ\n"
        "job = json.load(open(sys.argv[2]))\n"
        f"assert job['dtype'] == 'bfloat16' and job['model'] == {tiny_llama!r}, job\n"
        "outs = [[0] * r['output_len'] for r in job['requests']]\n"
        "print('a log line')\n"
        "json.dump({'version': '0.fake', 'dtype': job['dtype'], 'wall_s': 0.5,\n"
        "           'startup_s': 1.0, 'rss_after_mib': 321.0, 'outputs': outs},\n"
        "          open(job['result_path'], 'w'))\n"
        "print('INFO [shutdown] EngineCore: exiting busy loop')\n"
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nexec {sys.executable} {fake} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "res.json"
    argv = ["bench", "offline", "--model", tiny_llama, "--workload", str(wl), "--compare",
            "vllm", "--vllm-python", str(python), "--vllm-dtype", "bfloat16", "--json",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    peer = res["runs"][1]
    assert peer["engine"] == "vllm 0.fake bfloat16" and peer["dtype"] == "bfloat16"
    assert peer["output_tokens"] == 3 + 4 + 5 and peer["output_tok_per_s"] == pytest.approx(24)
    assert res["speedup_vs_vllm"] == pytest.approx(res["runs"][0]["output_tok_per_s"] / 24)
    assert 0 <= res["identical_greedy_outputs_vllm"] <= 3
    assert peer["rss_after_mib"] == 321.0
    printed = capsys.readouterr().out
    assert "fleetserve / vLLM (bfloat16)" in printed
    assert "RSS after the run 321 MiB (with its engine processes)" in printed


def test_a_failing_vllm_says_why(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\necho 'ModuleNotFoundError: No module named vllm'\nexit 1\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    args = _args(vllm_python=str(python))
    with pytest.raises(RuntimeError, match="exited 1:\nModuleNotFoundError"):
        offline_vllm.run_vllm_offline("/m", [BenchRequest([5], 1)], args, max_model_len=8)


def test_a_vllm_that_writes_no_result_says_so(tmp_path):
    """Exit 0 with only log lines on stdout (no result file) is a failure, not a parse of
    whatever the last log line was."""
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\necho '{\"not\": \"the result\"}'\necho 'INFO shutdown'\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    args = _args(vllm_python=str(python))
    with pytest.raises(RuntimeError, match="without writing its result:\n.*\nINFO shutdown"):
        offline_vllm.run_vllm_offline("/m", [BenchRequest([5], 1)], args, max_model_len=8)
