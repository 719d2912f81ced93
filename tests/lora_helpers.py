"""Tiny PEFT LoRA adapters for the tests (non-zero B, so every adapter changes tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_path: str,
    out: Path,
    seed: int,
    r: int = 8,
    alpha: float = 16.0,
    targets: list[str] | None = None,
    use_rslora: bool = False,
    bf16_exact: bool = True,
    std: float = 0.3,
    **extra: Any,
) -> str:
    """Save a PEFT LoRA adapter of `base_path` with random A and B to `out`.

    With `bf16_exact` every A and B value is a bfloat16 value (held in float32), so the
    engine's bf16 slots (lora_dtype auto) hold them exactly and greedy tokens can be
    compared with HF + peft token for token; the scalings the tests use (alpha / r,
    alpha / sqrt(r)) are powers of two, which keep B * scaling exact too. Adapters with
    arbitrary float32 values are tested separately (test_lora.py: lora_dtype)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        use_rslora=use_rslora,
        init_lora_weights=False,
        **extra,
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
                if bf16_exact:
                    p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(str(out))
    return str(out)


def peft_greedy(base_path: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """HF transformers (+ peft) greedy continuation of one prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def peft_logprobs(base_path: str, adapter: str | None, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


_OFFLINE: dict[tuple[str, str | None, tuple[int, ...], int], str] = {}


def offline_text(base_path: str, adapter: str | None, prompt: list[int], n: int = 10) -> str:
    """The offline engine's text for `n` greedy tokens of `prompt`, its tokens checked
    against HF transformers + peft (so a server's equal text stands for peft's tokens).
    Cached per process."""
    from fleetserve import LLM, SamplingParams
    from fleetserve.lora import LoRARequest

    key = (base_path, adapter, tuple(prompt), n)
    if key not in _OFFLINE:
        llm = LLM(base_path, enable_lora=True, max_lora_rank=8, max_model_len=128)
        lora = None if adapter is None else LoRARequest("x", 1, adapter)
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, params, lora_request=lora,
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert list(out.token_ids) == peft_greedy(base_path, adapter, prompt, n)
        _OFFLINE[key] = out.text
    return _OFFLINE[key]
