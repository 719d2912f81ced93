"""llama.cpp's own C++ benchmark, `llama-bench`, as a row of `fleetserve bench latency
--compare llamacpp`: tg N (N tokens decoded one at a time from an empty context) and pp P
(a P-token prompt in one batch) on the same GGUF file with the same thread count.

fleetserve neither ships nor builds the binary: it comes from the llama.cpp sources inside
the llama-cpp-python source distribution (docs/benchmarks.md has the three commands), and
its path is given by ``--llama-bench`` or ``$FLEETSERVE_LLAMA_BENCH`` (else ``llama-bench``
on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

ENV_VAR = "FLEETSERVE_LLAMA_BENCH"
BUILD_HINT = (
    "build it from the llama-cpp-python sdist: `pip download --no-deps --no-binary :all: "
    "llama-cpp-python`, untar, `cmake -S llama_cpp_python-*/vendor/llama.cpp -B BUILD "
    "-DGGML_NATIVE=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && "
    "cmake --build BUILD --target llama-bench` (docs/benchmarks.md)"
)


@dataclass(frozen=True)
class LlamaBenchResult:
    """The two tests' mean throughputs (tokens/s) and their standard deviations."""

    tg_tok_s: float
    tg_stddev: float
    pp_tok_s: float
    pp_stddev: float
    n_gen: int
    n_prompt: int
    threads: int
    build: str


def add_llama_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--llama-bench",
        default=os.environ.get(ENV_VAR),
        help=f"llama.cpp's llama-bench binary (default: ${ENV_VAR}, else llama-bench on PATH)",
    )
    p.add_argument(
        "--pp-tokens", type=int, default=512, help="prompt length of the pp test (both engines)"
    )


def find_llama_bench(path: str | None) -> str:
    """The binary to run; ValueError saying how to get one when there is none."""
    if not path:
        found = shutil.which("llama-bench")
        if found is None:
            raise ValueError(
                f"--compare llamacpp needs llama.cpp's llama-bench: pass --llama-bench PATH or "
                f"set ${ENV_VAR}; {BUILD_HINT}"
            )
        return found
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"--llama-bench {path!r} is not an executable file; {BUILD_HINT}")
    return path


def llama_bench_command(
    binary: str, model: str, threads: int, n_gen: int, n_prompt: int, repeats: int
) -> list[str]:
    """tg n_gen and pp n_prompt as two tests, `repeats` timed runs each, JSON on stdout."""
    return [
        binary, "-m", model, "-t", str(threads),
        "-n", str(n_gen), "-p", str(n_prompt),
        "-r", str(repeats), "-o", "json",
    ]  # fmt: skip


def parse_llama_bench(stdout: str) -> LlamaBenchResult:
    """llama-bench's `-o json` output (a list, one object per test) -> the tg and pp rows."""
    rows: list[dict[str, Any]] = json.loads(stdout)
    tg = [r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0]
    pp = [r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0]
    if len(tg) != 1 or len(pp) != 1:
        raise ValueError(
            f"llama-bench printed {len(tg)} tg and {len(pp)} pp tests, wanted one each"
        )
    return LlamaBenchResult(
        tg_tok_s=float(tg[0]["avg_ts"]),
        tg_stddev=float(tg[0]["stddev_ts"]),
        pp_tok_s=float(pp[0]["avg_ts"]),
        pp_stddev=float(pp[0]["stddev_ts"]),
        n_gen=int(tg[0]["n_gen"]),
        n_prompt=int(pp[0]["n_prompt"]),
        threads=int(tg[0]["n_threads"]),
        build=f"{tg[0].get('build_commit', '?')} ({tg[0].get('build_number', '?')})",
    )


def run_llama_bench(
    cmd: list[str], env: dict[str, str], timeout_s: float = 900
) -> LlamaBenchResult:
    """Runs `cmd` (from llama_bench_command); ValueError with its stderr's tail on failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode < 0:
        raise ValueError(
            f"llama-bench was killed by signal {-proc.returncode}; SIGILL/SIGSEGV at start is "
            "seen where the CPU flags AMX but the VM refuses it: rebuild with -DGGML_NATIVE=OFF "
            "and the AVX-512 options on, AMX off (docs/benchmarks.md)"
        )
    if proc.returncode != 0:
        raise ValueError(f"llama-bench exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    return parse_llama_bench(proc.stdout)
