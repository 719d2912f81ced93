"""The engine core's grammar engine: llguidance matchers over the model's tokenizer.

One `LLTokenizer` per engine (built on the first constrained request: ~0.5 s for a 49k
vocabulary); one compiled matcher per distinct grammar text (a small LRU), deep-copied for
each request, so n > 1 siblings and repeated schemas compile once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf

from fleetserve.core.request import Request
from fleetserve.core.structured import GrammarMatcher
from fleetserve.structured.grammars import check

CACHE_SIZE = 64


class LLGuidanceMatcher:
    """`GrammarMatcher` over one llguidance `LLMatcher`."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def consume(self, token_ids: list[int]) -> bool:
        return self._m.consume_tokens(token_ids)

    def validate_tokens(self, token_ids: list[int]) -> int:
        if not token_ids or self._m.is_error():
            return 0
        return self._m.validate_tokens(token_ids)

    def fill_bitmask(self, bitmask: Any, row: int, draft_token_ids: list[int]) -> None:
        row_bytes = bitmask.shape[1] * bitmask.itemsize
        base = bitmask.ctypes.data
        m = self._m
        m.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
        if not draft_token_ids:
            return
        # Rows past the first refused draft are never used: the target rejects there.
        num_valid = m.validate_tokens(draft_token_ids)
        for j in range(num_valid):
            m.consume_token(draft_token_ids[j])
            m.unsafe_compute_mask_ptr(base + (row + j + 1) * row_bytes, row_bytes)
        if num_valid:
            m.rollback(num_valid)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class GrammarBackend:
    """Compiles requests' constraints into matchers (engine-core side)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(set(eos_token_ids))
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                n_vocab = max(self._vocab_size, len(self._hf))
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=n_vocab, eos_token=self._eos or None
                )
            return self._tokenizer

    @property
    def mask_vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def matcher_for(self, request: Request) -> GrammarMatcher:
        """A fresh matcher for `request`, advanced past the tokens it already has (a
        request resumed after migration). ValueError names the field on a bad grammar."""
        so = request.sampling_params.structured_outputs
        assert so is not None
        grammar = check(so)
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs: {template.get_error()}")
            self._compiled[grammar] = template
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        matcher = LLGuidanceMatcher(template.deep_copy())
        if request.output_token_ids and not matcher.consume(request.output_token_ids):
            raise ValueError(
                "structured_outputs: the request's tokens so far do not match its grammar"
            )
        return matcher
