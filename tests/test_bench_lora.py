"""`fleetserve bench lora --compare`: arguments checked before any server starts, the
request bodies both servers get, and the summary table (bench/lora_peers.py). The
measurement itself (servers, vLLM) is a benchmark, run by hand: docs/benchmarks.md."""

from __future__ import annotations

import pytest

from fleetserve.bench.local_server import fleetserve_serve_cmd, vllm_cpu_env, vllm_serve_cmd
from fleetserve.bench.lora_peers import _body, _summary, table
from fleetserve.entrypoints.cli import main


def test_compare_vllm_needs_its_python(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEETSERVE_VLLM_PYTHON", raising=False)
    assert main(["bench", "lora", "--compare", "vllm"]) == 2
    assert "--vllm-python" in capsys.readouterr().err
    assert main(["bench", "lora", "--compare", "fleetserve", "--targets", "lm_head"]) == 2
    assert "--targets" in capsys.readouterr().err


def test_bodies_name_the_adapter_as_the_model() -> None:
    body = _body("a3", 7, 64)
    assert body["model"] == "a3" and body["max_tokens"] == 64 and body["ignore_eos"]
    assert "Request 7:" in body["prompt"] and body["stream"]


def test_summary_and_table_report_both_ratios() -> None:
    def run(tok_s: float, cpu: float) -> dict[str, object]:
        return {"tok_s": tok_s, "cpu_ms_per_token": cpu, "ttft_mean_ms": 1.0, "load_1m": 2.0,
                "errors": []}  # fmt: skip

    runs = {
        ("fleetserve", "base"): [run(100.0, 5.0)],
        ("fleetserve", "mixed"): [run(90.0, 6.0)],
        ("vllm", "base"): [run(100.0, 9.0)],
        ("vllm", "mixed"): [run(30.0, 30.0)],
    }
    cold = {"fleetserve": {"ttft_base_ms": 10.0, "ttft_loaded_adapter_ms": 11.0,
                           "ttft_cold_adapter_ms": 12.0, "load_route_ms": 5.0}}  # fmt: skip
    summary = _summary(runs, cold)
    assert summary["fleetserve"]["mixed_vs_base"] == pytest.approx(0.9)
    text = table(summary)
    assert "| fleetserve | 100.0 | 90.0 | 0.90 | 5.00 / 6.00 | 10 / 11 / 12 | 5 | 2.0 |" in text
    assert "mixed 3.00x" in text


def test_peer_server_commands_bind_localhost_and_pin_vllms_threads() -> None:
    """The launch shape lora_peers and structured_peers share (bench/local_server.py)."""
    cmd = fleetserve_serve_cmd(8123, "--model", "m")
    assert cmd[1:4] == ["-m", "fleetserve.entrypoints.cli", "serve"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[-2:] == ["--model", "m"] and "--access-log" in cmd
    cmd = vllm_serve_cmd("/venv/python", "/hf", "base", "bfloat16", 8124, "--enable-lora")
    assert cmd[:3] == ["/venv/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--served-model-name") + 1] == "base" and cmd[-1] == "--enable-lora"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8124"
    env = vllm_cpu_env(3, "/cache")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2" and env["VLLM_CACHE_ROOT"] == "/cache"
    assert vllm_cpu_env(1, "/c")["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["PYTHONPATH"] == "" and env["HF_HUB_OFFLINE"] == "1"
