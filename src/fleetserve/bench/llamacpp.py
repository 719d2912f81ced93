"""The fleetserve side of `--compare llamacpp` (bench latency, bench perplexity): one job
for bench/llamacpp_runner.py, run under the interpreter given by ``--llamacpp-python`` (a
separate environment with llama-cpp-python: fleetserve does not depend on it), its one
JSON result line read back."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("llamacpp_runner.py")


def add_llamacpp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compare", choices=["llamacpp"], default=None)
    p.add_argument(
        "--llamacpp-python",
        default=os.environ.get("FLEETSERVE_LLAMACPP_PYTHON", sys.executable),
        help="interpreter with llama-cpp-python installed (default: $FLEETSERVE_LLAMACPP_PYTHON "
        "or this one)",
    )


def require_gguf(model: str) -> None:
    if not str(model).endswith(".gguf"):
        raise ValueError("--compare llamacpp needs a .gguf --model (llama.cpp reads GGUF only)")


def run_job(python: str, job: dict[str, Any]) -> dict[str, Any]:
    """Runs one llamacpp_runner.py job under `python`; ValueError with its stderr's tail
    when it fails."""
    proc = subprocess.run(
        [python, str(RUNNER)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=peer_env(),
    )
    if proc.returncode != 0:
        raise ValueError(
            f"llama.cpp run failed under --llamacpp-python={python} (exit code "
            f"{proc.returncode}; a negative one is the signal that ended it, e.g. -11 where a "
            "-DGGML_NATIVE=ON build uses AMX a VM refuses; is llama-cpp-python installed "
            f"there?): {proc.stderr.strip()[-600:]}"
        )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def peer_env() -> dict[str, str]:
    """This process's environment without the OpenMP spin count fleetserve chose for
    itself (fleetserve/__init__.py): the peer runs as its users would run it."""
    import fleetserve

    env = dict(os.environ)
    if fleetserve.SET_GOMP_SPINCOUNT:
        env.pop("GOMP_SPINCOUNT", None)
    return env
