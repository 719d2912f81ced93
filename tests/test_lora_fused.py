"""LoRA inside the C step (lora/fused.py, kernels/lora.c's lora_step_*) against the module
path: a mixed batch of adapters and base rows (prefills wider than the decode-sized
shares, then decodes) generated once with the C step and once without it, on the same
engine (prefix cache emptied between). Greedy tokens must be identical and logprobs
equal to the C-step tests' tolerance; a counter proves the module path never ran while
the C step was on. Parity with HF + peft through the C step: tests/test_lora.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.lora import LoRARequest
from lora_helpers import make_adapter

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

LOGPROB_ATOL = 1e-5
# Qwen2's qkv bias on the quantized path: the module path adds it after the GEMM and
# then the delta, the C step the delta first and the bias while preparing the heads, so
# the sums round differently (tokens still identical).
LOGPROB_ATOL_REORDERED = 1e-4


def _runner(llm: LLM) -> Any:
    return llm.engine.core.executor.runner  # type: ignore[attr-defined]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 5 .. 40 tokens: the first step's prefill rows outnumber the
    decode-sized GEMM shares (the C step's wide path), later steps are decodes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (5 + 5 * i,), generator=g).tolist() for i in range(n)]


def _generate(
    llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]
) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm.engine.core.block_manager.reset_prefix_cache()  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    items = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(items, params, lora_request=loras, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]  # type: ignore[misc]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def setup(
    request: pytest.FixtureRequest,
    tiny_model_factory: Callable[..., str],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, list[LoRARequest | None]]:
    """A base and a mixed batch: an all-projection adapter (r 8), a q/v + down one (r 4),
    an MLP-only one (r 6) and base rows, interleaved."""
    base = tiny_model_factory(request.param)
    root = tmp_path_factory.mktemp(f"lora-fused-{request.param}")
    paths = [
        make_adapter(base, root / "all", 1),
        make_adapter(base, root / "qv", 2, r=4, targets=["q_proj", "v_proj", "down_proj"]),
        make_adapter(base, root / "mlp", 3, r=6, targets=["gate_proj", "up_proj", "down_proj"]),
    ]
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    return base, [loras[0], None, loras[1], loras[2], loras[0], None, loras[2], loras[1]]


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("lora_dtype", ["bfloat16", "float32"])
def test_c_step_applies_adapters_like_the_module_path(
    setup: tuple[str, list[LoRARequest | None]],
    quantization: str | None,
    lora_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base, loras = setup
    llm = LLM(
        base, enable_lora=True, max_loras=3, max_lora_rank=8, max_model_len=128,
        quantization=quantization, lora_dtype=lora_dtype, enable_prefix_caching=False,
    )  # fmt: skip
    model = _runner(llm).model.model
    assert model.decode_plan is not None and model.decode_lora is not None
    steps = {"c": 0, "module": 0}
    run = model.decode_plan.run

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        steps["c"] += kwargs.get("lora") is not None or (len(args) > 9 and args[9] is not None)
        return run(*args, **kwargs)

    monkeypatch.setattr(model.decode_plan, "run", counted)

    def module_hook(*_: object) -> None:
        steps["module"] += 1

    model.layers[0].register_forward_pre_hook(module_hook)
    prompts = _prompts(len(loras))
    on = _generate(llm, prompts, loras)
    assert steps["module"] == 0 and steps["c"] > 0, steps
    monkeypatch.setattr(model, "decode_plan", None)
    off = _generate(llm, prompts, loras)
    assert steps["module"] > 0
    worst = 0.0
    for i, ((t_on, lp_on), (t_off, lp_off)) in enumerate(zip(on, off, strict=True)):
        assert t_on == t_off, f"request {i} ({loras[i]}): tokens differ"
        for a, b in zip(lp_on, lp_off, strict=True):
            assert a.keys() == b.keys()
            worst = max(worst, *(abs(a[t] - b[t]) for t in a))
    reordered = quantization is not None and "qwen2" in Path(base).name
    assert worst <= (LOGPROB_ATOL_REORDERED if reordered else LOGPROB_ATOL), worst
    # The adapters change the tokens (so the comparison could fail).
    plain = _generate(llm, prompts[:1], [None])
    assert plain[0][0] != on[0][0]


def test_slots_the_c_step_cannot_read_keep_the_module_path(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Without the C step (FLEETSERVE_FUSED_DECODE=0 here: no plan) adapter rows run the
    module path's kernel; no FusedLoRA is bound."""
    base = tiny_model_factory("llama")
    adapter = make_adapter(base, tmp_path / "a", 1)
    llm = LLM(
        base, enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64,
        attention_backend="torch",
    )  # fmt: skip
    model = _runner(llm).model.model
    assert model.decode_plan is None and model.decode_lora is None
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0),
        lora_request=[LoRARequest("a", 1, adapter)], use_tqdm=False,
    )  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 3
