"""A thin wrapper over a transformers fast tokenizer, with the few things the engine needs:
ids in and out, the chat template, and the set of token ids that end a generation."""

from __future__ import annotations

import functools
from typing import Any

from fleetserve.models.loader import ModelSource


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    def __init__(self, hf: Any, extra_stop_token_ids: list[int] | None = None) -> None:
        self.hf = hf
        self.vocab_size: int = len(hf)
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        stops = set(extra_stop_token_ids or [])
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        self.stop_token_ids: set[int] = stops

    @classmethod
    def from_source(cls, source: ModelSource) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(source.tokenizer_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"no usable tokenizer in {source.tokenizer_dir}: {e}") from e
        if not getattr(hf, "is_fast", False):
            raise ValueError(
                f"the tokenizer in {source.tokenizer_dir} is not a fast (tokenizers) one; "
                "fleetserve needs tokenizer.json"
            )
        # Chat models list their end-of-turn tokens (<|im_end|>, <|eot_id|>) next to eos here.
        stops = _as_ids(source.hf_config.get("eos_token_id"))
        stops += _as_ids(source.generation_config.get("eos_token_id"))
        return cls(hf, stops)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry
        (byte-level entries spell one character per byte, so this bounds the text's
        characters too). A text of more than `n * max_token_chars` characters has more
        than n tokens, which is known without tokenizing it."""
        return max((len(k) for k in self.hf.get_vocab()), default=1) or 1

    def check_length(self, text: str, max_model_len: int, what: str = "prompt") -> None:
        """ValueError when `text` cannot be a prompt shorter than `max_model_len` tokens,
        judged by its length alone: a huge text is refused before the tokenizer spends
        time and memory on it."""
        most = max_model_len - 1
        if len(text) > most * self.max_token_chars:
            raise ValueError(
                f"{what} has more than {most} tokens ({len(text)} characters; a token of "
                f"this model spells at most {self.max_token_chars}) but max_model_len is "
                f"{max_model_len}"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text for `messages` (special tokens spelled out)."""
        if not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; send a plain prompt "
                "(completions API) instead of messages"
            )
        return self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
    ) -> list[int]:
        """`max_model_len`: a rendered text too long to fit is refused (ValueError) before
        it is tokenized."""
        text = self.render_chat(messages, add_generation_prompt)
        if max_model_len is not None:
            self.check_length(text, max_model_len, "the chat prompt")
        # The template already writes any BOS it wants; adding special tokens would double it.
        return self.encode(text, add_special_tokens=False)
