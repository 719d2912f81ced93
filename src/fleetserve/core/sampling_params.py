"""Per-request sampling settings, validated once at the API boundary."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from fleetserve.core.structured import StructuredOutputsParams

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


def is_valid_unicode(text: str) -> bool:
    """False for text UTF-8 cannot encode (lone UTF-16 surrogates, e.g. from JSON "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    """What to generate and how, in vLLM's vocabulary.

    temperature 0 means greedy. ``top_k=-1`` (or 0) means no top-k cut. ``seed`` makes
    one request's sampling reproducible regardless of what else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output held to a JSON schema, regex, choice list or grammar by a token mask.
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(name: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.temperature < 0.0:
            raise bad("temperature", ">= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 (disabled) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "> 0", self.repetition_penalty)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if self.min_tokens < 0:
            raise bad("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if len(self._stop_list) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} strings", len(self._stop_list))
        if any(not isinstance(s, str) or s == "" for s in self._stop_list):
            raise bad("stop", "non-empty strings", self.stop)
        if not all(is_valid_unicode(s) for s in self._stop_list):
            raise ValueError("stop holds text that is not valid Unicode (a lone surrogate)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}]", v)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer", self.seed)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)

    def for_choice(self, index: int) -> SamplingParams:
        """The settings of choice `index` of an n > 1 request: a seeded request's choices
        each draw their own numbers (seed + index, as vLLM does), reproducibly."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=self.seed + index)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


# The fields a caller sets, in declaration order: the wire struct (engine/wire.py) and the
# HTTP body models derive from this one list, so a new sampling field is added once.
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.init)
