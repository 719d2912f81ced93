"""What generate() returns, in vLLM's shape, and how its deltas add up.

An engine client yields a request's outputs as deltas (vLLM v1's `RequestOutputKind.DELTA`):
each `RequestOutput` holds what is new since the previous one its reader got:

    outputs        the choices that changed: new token ids, new text, new logprobs, and
                   `finish_reason` set in the one delta where the choice ends
    finished       every choice has ended (the last delta)
    prompt_logprobs once, in the delta that first carries them
    cumulative_logprob, num_cached_tokens, metrics: the newest value (not a delta)

A reader that falls behind gets the merged delta of everything it missed (`merge_delta`):
nothing is skipped and nothing is copied per token. The few places that need the whole
answer (a non-streaming response, `LLM.generate`, migration's resume, the Batch API) fold
the deltas themselves with an `OutputFold`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# One generated position: token id -> logprob, for the sampled token plus the top-N.
Logprobs = dict[int, float]


class RequestOutputKind(enum.Enum):
    """What one `RequestOutput` of a stream holds."""

    DELTA = "delta"  # what is new since the previous output (every engine client yields these)
    CUMULATIVE = "cumulative"  # everything so far (what an OutputFold gives)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    kind: RequestOutputKind = RequestOutputKind.DELTA


def merge_delta(into: RequestOutput, later: RequestOutput) -> None:
    """Adds the delta `later` to the delta `into` (in place): `into` becomes the one delta
    that says what both said. `into` must be owned by the caller (not yet handed to a
    reader); `later` is not changed. Costs what `later` holds, not what came before."""
    for c in later.outputs:
        mine = next((m for m in into.outputs if m.index == c.index), None)
        if mine is None:
            into.outputs.append(
                CompletionOutput(
                    c.index,
                    c.text,
                    list(c.token_ids),
                    c.finish_reason,
                    c.stop_reason,
                    None if c.logprobs is None else list(c.logprobs),
                    c.cumulative_logprob,
                )  # fmt: skip
            )
            continue
        mine.token_ids.extend(c.token_ids)
        mine.text += c.text
        if c.logprobs is not None:
            if mine.logprobs is None:
                mine.logprobs = []
            mine.logprobs.extend(c.logprobs)
        mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        mine.cumulative_logprob = c.cumulative_logprob
    into.finished = later.finished
    if into.prompt_logprobs is None:
        into.prompt_logprobs = later.prompt_logprobs
    into.num_cached_tokens = later.num_cached_tokens
    into.metrics = later.metrics


@dataclass
class _ChoiceFold:
    index: int
    token_ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # joined when the whole text is asked for
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


class OutputFold:
    """A request's whole answer so far, from its deltas (`add`); `output()` is a
    cumulative RequestOutput the caller may keep. Adding costs what the delta holds.
    `n`: the request's choices (more are added as deltas name them); `start`: a
    cumulative output to go on from (a resumed request's)."""

    def __init__(self, request_id: str, n: int = 1, start: RequestOutput | None = None) -> None:
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self._choices = [_ChoiceFold(i) for i in range(n)]
        self.finished = False
        self.prompt_logprobs: list[Logprobs | None] | None = None
        self.num_cached_tokens = 0
        self.metrics: dict[str, float] = {}
        self.num_deltas = 0
        if start is not None:
            self.add(start)

    @property
    def started(self) -> bool:
        """At least one output was added."""
        return self.num_deltas > 0

    def add(self, delta: RequestOutput) -> None:
        self.num_deltas += 1
        if not self.prompt_token_ids:
            self.prompt, self.prompt_token_ids = delta.prompt, delta.prompt_token_ids
        for c in delta.outputs:
            while c.index >= len(self._choices):  # `n` was not known: one more choice
                self._choices.append(_ChoiceFold(len(self._choices)))
            f = self._choices[c.index]
            f.token_ids.extend(c.token_ids)
            if c.text:
                f.parts.append(c.text)
            if c.logprobs is not None:
                if f.logprobs is None:
                    f.logprobs = []
                f.logprobs.extend(c.logprobs)
            f.finish_reason, f.stop_reason = c.finish_reason, c.stop_reason
            f.cumulative_logprob = c.cumulative_logprob
        self.finished = delta.finished
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.metrics:
            self.metrics = delta.metrics

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, over every choice."""
        return sum(len(f.token_ids) for f in self._choices)

    def max_choice_tokens(self) -> int:
        return max((len(f.token_ids) for f in self._choices), default=0)

    def tokens_so_far(self) -> list[int]:
        """Every choice's tokens, in choice order (what a resumed request prefills)."""
        return [t for f in self._choices for t in f.token_ids]

    def output(self) -> RequestOutput:
        """Everything so far, as one cumulative RequestOutput (lists copied)."""
        choices = [
            CompletionOutput(
                f.index,
                f.text(),
                list(f.token_ids),
                f.finish_reason,
                f.stop_reason,
                None if f.logprobs is None else list(f.logprobs),
                f.cumulative_logprob,
            )  # fmt: skip
            for f in self._choices
        ]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, choices,
                             self.finished, self.prompt_logprobs, self.num_cached_tokens,
                             dict(self.metrics), RequestOutputKind.CUMULATIVE)  # fmt: skip


def fold(deltas: list[RequestOutput], n: int | None = None) -> RequestOutput:
    """The cumulative output of a request's deltas (`n`: its choices; default: as many
    as the deltas name)."""
    assert deltas, "nothing to fold"
    acc = OutputFold(deltas[0].request_id, n or 1)
    for d in deltas:
        acc.add(d)
    return acc.output()
