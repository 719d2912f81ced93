"""MoE checkpoints in GGUF (llama.cpp's stacked expert tensors) load and match.

- A float32 GGUF of each tiny MoE checkpoint (its names, metadata and, for Mixtral, the
  q/k permutation of llama.cpp's "llama" architecture) gives HF's greedy tokens.
- Experts kept in GGUF blocks (gate Q8_0 and up Q4_0: two segments per expert; down and
  the shared expert Q8_0) run through the grouped kernel's quantized GEMMs and agree
  with the same file dequantized to float32 to 1e-4 in every prompt logprob.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.quant import QuantWeight
from fleetserve.layers.quant_linear import QuantLinear
from fleetserve.models.moe import MoeForCausalLM
from helpers import prompt_logprobs
from moe_gguf import write_tiny_moe_gguf
from test_hf_parity import GREEDY, PROMPTS, hf_greedy, run_engine

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A fresh FLEETSERVE_CACHE for the tokenizer conversions of this module's files. Its
    kernels folder is the built one: a TP worker (a new process) would otherwise compile
    the whole kernel library again, each rank at once (40 s of CPU under load)."""
    built = cpu_kernels._cache_dir()  # before the variable changes
    fresh = tmp_path_factory.mktemp("moe-gguf-cache")
    if built.is_dir():
        (fresh / built.name).symlink_to(built, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("FLEETSERVE_CACHE", str(fresh))
    yield
    mp.undo()


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_gguf_matches_hf(
    arch: str, tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    hf_dir = tiny_model_factory(arch)
    path = str(tmp_path / f"{arch}.gguf")
    write_tiny_moe_gguf(hf_dir, path)
    tokens, _, _ = run_engine(path, GREEDY, max_num_batched_tokens=8, block_size=4)
    for i, expected in enumerate(hf_greedy(hf_dir)):
        assert tokens[str(i)] == expected, f"prompt {i} (len {len(PROMPTS[i])})"


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_experts_match_dequantized(
    arch: str, tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    import gguf

    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    qtypes = {"ffn_gate_exps": q8, "ffn_up_exps": q4, "ffn_down_exps": q8}
    qtypes.update({k: q8 for k in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")})
    path = str(tmp_path / f"{arch}-q.gguf")
    write_tiny_moe_gguf(tiny_model_factory(arch), path, qtypes)
    # Float32 activations: the blocks' own arithmetic against the dequantized weights;
    # dtype float32 keeps both KV caches float32 (auto gives GGUF weights a bf16 one on
    # CPUs with native bf16 where FLEETSERVE_AUTO_BF16 allows).
    common = dict(max_model_len=256, num_kv_blocks=64, dtype="float32")
    quant = LLM(path, int8_activations=False, **common)
    plain = LLM(path, quantization="none", **common)
    assert quant.engine.config.quantization == "gguf"
    model = quant.engine.core.executor.runner.model  # type: ignore[attr-defined]
    assert isinstance(model, MoeForCausalLM)
    for block in model.moe_blocks():
        kw = block.experts.kernel_weights
        assert kw is not None and all(len(s) == 2 for s in kw.gate_up)
        assert all(isinstance(w, QuantWeight) for w in kw.down)
        if block.shared_expert is not None:
            assert isinstance(block.shared_expert.gate_up_proj, QuantLinear)
    g = torch.Generator().manual_seed(4)
    for n in (1, 7, 60):  # a decode-sized and a prefill-sized batch of rows per expert
        ids = torch.randint(3, 512, (n + 1,), generator=g).tolist()
        torch.testing.assert_close(
            prompt_logprobs(quant, ids)[0], prompt_logprobs(plain, ids)[0], rtol=0, atol=1e-4
        )
    quant.engine.shutdown()
    plain.engine.shutdown()


@pytest.mark.slow
def test_gguf_expert_parallel_matches_one_process(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    """TP=2 with expert parallelism reads llama.cpp's stacked experts rank by rank."""
    hf_dir = tiny_model_factory("qwen2_moe")
    path = str(tmp_path / "qwen2_moe.gguf")
    write_tiny_moe_gguf(hf_dir, path)
    g = torch.Generator().manual_seed(2)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (3, 17, 40)
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(hf_dir, max_model_len=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, max_model_len=128, tensor_parallel_size=2, expert_parallel=True)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
