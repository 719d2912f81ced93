"""`fleetserve make-model`: write a random-weight HF checkpoint for tests and benchmarks.

The checkpoint is built with transformers' own config and model classes and saved with
`save_pretrained`, so transformers can always load it back; that makes it a fair reference
for parity tests. The tokenizer is a real byte-level BPE trained offline on a small generated
corpus, with ChatML special tokens and chat template.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from typing import Any

import torch

ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
SIZES = ("tiny", "bench")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    "bench": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        vocab_size=32000,
    ),
}
_TOKENIZER_VOCAB = {"tiny": 640, "bench": 2048}

# Mixture-of-experts fields per (arch, size). The bench Mixtral's active MLP (top-2 of 8
# experts of 1024) matches the dense bench model's intermediate_size of 2048.
_MOE_FIELDS: dict[tuple[str, str], dict[str, Any]] = {
    ("mixtral", "tiny"): dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    ("mixtral", "bench"): dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1024),
    ("qwen2_moe", "tiny"): dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
    ),
    ("qwen2_moe", "bench"): dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=1024,
        norm_topk_prob=False,
    ),
    ("qwen3_moe", "tiny"): dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    ("qwen3_moe", "bench"): dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024, norm_topk_prob=True
    ),
}

_SUBJECTS = [
    "the cat",
    "a small dog",
    "my friend",
    "the old sailor",
    "our teacher",
    "the robot",
    "a young girl",
    "the king",
    "every student",
    "the farmer",
]
_VERBS = [
    "found",
    "painted",
    "carried",
    "watched",
    "opened",
    "remembered",
    "cooked",
    "counted",
    "followed",
    "built",
]
_OBJECTS = [
    "a red box",
    "the long river",
    "seven apples",
    "a quiet garden",
    "the broken clock",
    "three letters",
    "the blue door",
    "a warm bowl of soup",
    "the map",
    "an empty room",
]
_TAILS = [
    "in the morning",
    "before the storm",
    "near the station",
    "with great care",
    "after dinner",
    "under the bridge",
    "at the market",
    "for a while",
    "without a word",
    "on a rainy day",
]
# A little non-ASCII so multi-byte characters end up split across byte-level tokens.
_EXTRAS = ["café", "naïve", "東京", "こんにちは", "🙂", "🚀", "Straße", "ñandú", "1234", "3.14"]


def training_corpus(num_sentences: int = 600, seed: int = 0) -> list[str]:
    """Deterministic English-ish sentences (a few tens of KB)."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_sentences):
        words = [
            rng.choice(_SUBJECTS),
            rng.choice(_VERBS),
            rng.choice(_OBJECTS),
            rng.choice(_TAILS),
        ]
        sentence = " ".join(words).capitalize()
        if i % 7 == 0:
            sentence += f" ({rng.choice(_EXTRAS)})"
        lines.append(sentence + rng.choice([".", "!", "?", "."]))
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer`; special tokens take ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    return tok


def _save_tokenizer(tok: Any, out_dir: str) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(out_dir)
    # Readers that predate chat_template.jinja look for the template here.
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = CHATML_TEMPLATE
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def _hf_config(arch: str, fields: dict[str, Any]) -> Any:
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    cls = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mixtral": MixtralConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "gemma3": Gemma3TextConfig,
    }
    if arch in ("mistral", "mixtral"):
        fields.setdefault("sliding_window", None)
    if arch == "gemma3":
        # Gemma 3's shape in small: local layers with a short window between global
        # ones (every 2nd here, every 6th in the real models), two RoPE bases.
        n = fields["num_hidden_layers"]
        fields.setdefault("sliding_window", 16)
        fields.setdefault(
            "layer_types",
            ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(n)],
        )
        fields.setdefault("query_pre_attn_scalar", fields["head_dim"])
        fields["rope_theta"] = fields.get("rope_theta_global", 1_000_000.0)
        fields.pop("rope_theta_global", None)
        fields.setdefault("rope_local_base_freq", 10_000.0)
        fields.setdefault("architectures", ["Gemma3ForCausalLM"])
    return cls[arch](**fields)


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights that make a model with decisive, context-dependent greedy outputs.

    HF's default init (std 0.02, norms 1, biases 0) gives near-uniform logits that mostly
    depend on the last token, and leaves norms and biases untested. Here every projection
    preserves variance, so attention matters; norms and biases are random, so forgetting one
    changes the output; and the lm_head is scaled so the top logits are well separated.
    """
    gen = torch.Generator().manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        elif name == "model.embed_tokens.weight":
            # Tied to the lm_head, a large embedding makes the current token its own best
            # successor ("cat cat cat"); a small one lets the layers' outputs dominate.
            std = 1.0 / math.sqrt(param.shape[1]) if tied else 1.0
            param.copy_(std * torch.randn(param.shape, generator=gen))
        elif name == "lm_head.weight":
            param.copy_(4.0 / math.sqrt(param.shape[1]) * torch.randn(param.shape, generator=gen))
        else:
            # Linear [out_features, in_features], or stacked experts [E, out, in]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))


def make_model(
    out_dir: str,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> str:
    """Write a random `arch` checkpoint of `size` to `out_dir`; returns `out_dir`.

    `overrides` replace HF config fields (e.g. num_key_value_heads=1, head_dim=32,
    tie_word_embeddings=True, rope_scaling={...}). `max_shard_size` (e.g. "50KB") splits the
    weights into several safetensors shards with an index.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = train_tokenizer(_TOKENIZER_VOCAB[size], seed=0)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    fields: dict[str, Any] = dict(_SIZES[size])
    fields.update(_MOE_FIELDS.get((arch, size), {}))
    # Pad to a multiple of 64, as real checkpoints do, so rows past the tokenizer exist.
    fields.setdefault("vocab_size", 64 * math.ceil(tok.get_vocab_size() / 64))
    fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    fields.update(overrides)
    if fields["vocab_size"] < tok.get_vocab_size():
        raise ValueError(
            f"vocab_size must be >= the tokenizer's {tok.get_vocab_size()}, got {fields['vocab_size']}"
        )
    config = _hf_config(arch, fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    os.makedirs(out_dir, exist_ok=True)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out_dir)
    _save_tokenizer(tok, out_dir)
    return out_dir


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help='e.g. "100MB"; default: one file')
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="config field override, e.g. --override num_key_value_heads=1 (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    overrides = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--override must be KEY=JSON, got {item!r}")
        overrides[key] = json.loads(value)
    out = make_model(
        args.out_dir, args.arch, args.size, args.seed, args.max_shard_size, **overrides
    )
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fleetserve make-model", description="Write a random-weight HF checkpoint."
    )
    add_cli_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
