"""Streaming detokenization: turn each step's new token ids into only the new text.

Decoding a token alone is wrong in general: byte-level BPE splits one UTF-8 character across
tokens, and SentencePiece decoders drop a leading space at the start of a decode call. So each
step decodes a short window of trailing tokens twice, with and without the new ones, and emits
the difference (vLLM's approach):

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 '--- already emitted ---'-- not yet emitted --'

`prefix_offset` starts the window a few tokens back so the decoder sees context; text is
emitted only when it does not end in U+FFFD (an incomplete character), and then both offsets
move forward, so the window stays a handful of tokens long.
"""

from __future__ import annotations

from fleetserve.tokenizer import Tokenizer

# Tokens of prompt context decoded with the first generated tokens. A UTF-8 character is at
# most 4 bytes and every non-special token carries at least one, so 5 covers one character.
_INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _INITIAL_CONTEXT_TOKENS, 0)
        self._pieces: list[str] = []

    @property
    def output_text(self) -> str:
        """All text emitted so far (excludes a held-back incomplete character)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (may be empty)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            # Nothing visible yet (a special token skipped) or a character is still incomplete:
            # keep the offsets, so the next call decodes these ids again with their successors.
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(new_text)
        return new_text

    def flush(self) -> str:
        """Emit whatever is held back, U+FFFD included; call once when the request finishes.

        Only a sequence that ends mid-character (e.g. cut by max_tokens) has anything here.
        """
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        new_text = full_text[len(prefix_text) :]
        if new_text:
            self._pieces.append(new_text)
        return new_text
