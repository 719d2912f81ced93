"""bf16 weights (`bf16_weights`) against HF transformers run in bfloat16 on tiny random
checkpoints: the same greedy token ids over a short run, and each chosen token's logprob
close to HF's. HF at bfloat16 rounds everything (norms, residual stream, attention, the
LM head's input); fleetserve rounds only the weights and the GEMM inputs and keeps the
rest float32, so the logprobs differ by rounding, not by a defect: measured at most 0.05
nats on llama/qwen2/mistral and 0.14 on one qwen3 prompt (the same distance from HF at
float32). The float32 path against HF float32, bit for bit in tokens, is
tests/test_hf_parity.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

NUM_TOKENS = 8
LOGPROB_TOL = 0.2  # nats; see the module docstring for the measured distances


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (5 + 6 * i,), generator=g).tolist() for i in range(4)]


def _chosen(tokens: list[int], rows: list[dict[int, float]]) -> list[float]:
    return [row[t] for row, t in zip(rows, tokens, strict=True)]


def _ours(path: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, bf16_weights=True, max_model_len=128, block_size=4, num_kv_blocks=96)
    assert llm.engine.config.bf16_weights
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        res.append((list(c.token_ids), _chosen(list(c.token_ids), c.logprobs)))
    llm.engine.shutdown()
    return res


def _hf_bf16(path: str) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    res = []
    with torch.inference_mode():
        for p in _prompts():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                do_sample=False, output_scores=True, return_dict_in_generate=True,
                pad_token_id=0,
            )  # fmt: skip
            toks = out.sequences[0, len(p) :].tolist()
            scores = zip(out.scores, toks, strict=True)
            lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in scores]
            res.append((toks, lps))
    return res


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_bf16_weights_match_hf_in_bfloat16(
    arch: str, tiny_model_factory: Callable[..., str]
) -> None:
    path = tiny_model_factory(arch)
    ours, ref = _ours(path), _hf_bf16(path)
    for (t_ours, lp_ours), (t_ref, lp_ref) in zip(ours, ref, strict=True):
        assert t_ours == t_ref
        worst = max(abs(a - b) for a, b in zip(lp_ours, lp_ref, strict=True))
        assert worst < LOGPROB_TOL, (arch, worst)
