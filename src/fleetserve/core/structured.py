"""Structured outputs as the core sees them: what a request asks for, and the grammar
matcher that the engine core owns per request (pure Python; the grammar engine itself,
llguidance, lives behind `GrammarMatcher` in fleetserve/structured/).

    admission     EngineCore.add_request compiles the request's grammar (cached by text)
                  into a matcher; a resumed request's matcher consumes its tokens so far
    each step     the matcher of each request that samples fills its bitmask rows (one per
                  sampled position: the pending token and each draft) -> SchedulerOutput
    sampler       forbidden tokens' logits -> -inf before sampling (and logprobs)
    update        the matcher consumes the accepted tokens; drafts are cut at the first
                  token it would refuse; a grammar that can only end finishes the request
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of the five constraints.

    json: a JSON schema (dict or its JSON text); regex: the whole output matches it;
    choice: the output is one of these strings; grammar: a Lark or GBNF (llama.cpp)
    grammar; json_object: any JSON object.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str) or c == "":
                    raise ValueError(f"structured_outputs.choice.{i} must be a non-empty string")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


class GrammarMatcher(Protocol):
    """One request's position in its grammar. Calls come from the engine core's thread,
    except `fill_bitmask`, which the step's mask thread may run while the forward pass
    does; the core never mutates a matcher while its step's masks are being filled."""

    def consume(self, token_ids: list[int]) -> bool:
        """Advance past accepted tokens; False when the grammar refuses one."""
        ...

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (a prefix) the grammar would accept now; no change."""
        ...

    def fill_bitmask(self, bitmask: Any, row: int, draft_token_ids: list[int]) -> None:
        """Row `row` of `bitmask` (int32 [rows, words], bit t of word t//32: token t
        allowed) for the next token; rows row+1.. for the token after each draft, as if
        the drafts were accepted (the matcher is left where it was)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more than ending."""
        ...


@dataclass
class GrammarBitmask:
    """The masks of one step: `rows[req_id]` is the first row of that request (one row
    per sampled position). `bits` is filled by the mask thread while the forward pass
    runs; `wait()` before reading it (pickling waits too: TP/PP workers get it whole)."""

    rows: dict[str, int]
    bits: Any  # numpy int32 [num_rows, ceil(vocab / 32)]
    # The same rows as an additive logit bias, 0 (allowed) or -inf, float32
    # [num_rows, 32 * words]: made on the mask thread too, so the sampler only adds it
    # (an add is ~15x cheaper than a masked fill on a 49k vocabulary).
    bias: Any = None
    _done: threading.Event | None = field(default=None, repr=False)
    fill_seconds: float = 0.0
    error: str | None = None

    def wait(self) -> Any:
        """The bias rows once filled."""
        if self._done is not None:
            self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"filling the grammar masks failed: {self.error}")
        if self.bias is None:
            self.bias = bitmask_bias(self.bits)
        return self.bias

    def __getstate__(self) -> dict[str, Any]:
        # TP/PP workers get the packed bits (1/32 of the bias) and unpack them there.
        self.wait()
        state = dict(self.__dict__)
        state["_done"] = None
        state["bias"] = None
        return state


def bitmask_bias(bits: Any) -> Any:
    """Packed rows (int32, bit t % 32 of word t // 32) -> float32 0 / -inf per token."""
    import numpy as np  # the core imports no numpy at module level; only this does

    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    return np.where(allowed, np.float32(0.0), np.float32(-np.inf))
