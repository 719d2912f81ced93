"""A thin wrapper over a fast tokenizer, with the few things the engine needs: ids in and
out, the chat template, and the set of token ids that end a generation. The tokenizer is
read from the folder's files without transformers where that gives transformers' results
(tokenizer_files.py: the API process starts ~1.7 s of CPU sooner), else it is
transformers' AutoTokenizer; `transformers()` gives the latter on demand."""

from __future__ import annotations

import functools
import re
from functools import cached_property
from typing import Any

from fleetserve.models.loader import ModelSource


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each byte is spelled by one printable character;
    this maps the characters back to their bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _auto_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {folder}: {e}") from e
    if not getattr(hf, "is_fast", False):
        raise ValueError(
            f"the tokenizer in {folder} is not a fast (tokenizers) one; fleetserve needs "
            "tokenizer.json"
        )
    return hf


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


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
        self._transformers: Any = None

    @classmethod
    def from_source(cls, source: ModelSource) -> Tokenizer:
        """The folder's tokenizer, read by tokenizer_files.py without transformers where it
        can promise transformers' results, else by transformers' AutoTokenizer."""
        from fleetserve.tokenizer_files import load

        # Chat models list their end-of-turn tokens (<|im_end|>, <|eot_id|>) next to eos here.
        stops = _as_ids(source.hf_config.get("eos_token_id"))
        stops += _as_ids(source.generation_config.get("eos_token_id"))
        try:
            files = load(source.tokenizer_dir)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"no usable tokenizer in {source.tokenizer_dir}: {e}") from e
        if files is not None:
            return cls(files, stops)
        return cls(_auto_tokenizer(source.tokenizer_dir), stops)

    def transformers(self) -> Any:
        """The transformers tokenizer of this one (what llguidance and other libraries
        take), loaded on first use where this one was read from the files."""
        from fleetserve.tokenizer_files import FilesTokenizer

        if isinstance(self.hf, FilesTokenizer):
            if self._transformers is None:
                self._transformers = _auto_tokenizer(self.hf.folder)
            return self._transformers
        return self.hf

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

    @cached_property
    def _byte_level(self) -> bool:
        backend = getattr(self.hf, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        return "ByteLevel" in repr(decoder)

    @cached_property
    def _byte_decoder(self) -> dict[str, int]:
        return _byte_decoder()

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a byte-piece of an emoji is that byte, not U+FFFD), so
        that joining a reply's tokens' bytes rebuilds its UTF-8 text."""
        piece = self.hf.convert_ids_to_tokens([token_id])[0]
        if piece is None:
            return b""
        if token_id in self.hf.all_special_ids or piece in self.hf.get_added_vocab():
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if self._byte_level:
            table = self._byte_decoder
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        m = _BYTE_PIECE.match(piece)
        if m:  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        if "\u2581" in piece:  # SentencePiece's word boundary
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) else None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template's text for `messages` (special tokens spelled out)."""
        if not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; send a plain prompt "
                "(completions API) instead of messages"
            )
        return self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        max_model_len: int | None = None,
    ) -> list[int]:
        """`tools`: rendered by the template when it takes them. `max_model_len`: a rendered
        text too long to fit is refused (ValueError) before it is tokenized."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        if max_model_len is not None:
            self.check_length(text, max_model_len, "the chat prompt")
        # The template already writes any BOS it wants; adding special tokens would double it.
        return self.encode(text, add_special_tokens=False)
