"""Which prompts and sampling settings an engine accepts (PromptRules), shared by the
offline LLMEngine (llm_engine.py) and the API process's AsyncEngine and services; kept
apart from the engine so the API process imports no engine core (and no torch)."""

from __future__ import annotations

from typing import Any

from fleetserve.config import EngineConfig
from fleetserve.core.sampling_params import SamplingParams, is_valid_unicode
from fleetserve.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]


class PromptRules:
    """Which prompts and sampling settings an engine accepts. The offline LLMEngine and
    the server's AsyncEngine share one instance type, so both refuse the same input."""

    def __init__(self, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt must not be empty")
            if not is_valid_unicode(prompt):
                raise ValueError("prompt holds text that is not valid Unicode (a lone surrogate)")
            # Longer than max_model_len tokens could hold: refused without tokenizing it.
            self.tokenizer.check_length(prompt, self.max_model_len)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        else:
            ids, text = prompt, None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if text is not None and (not isinstance(text, str) or not is_valid_unicode(text)):
            raise ValueError("prompt must be a string of valid Unicode")
        return text, list(ids)

    def fit_kv(self, num_prompt: int, params: SamplingParams, capacity: int | None) -> None:
        """Checks the prompt and max_tokens fit min(max_model_len, `capacity` tokens of KV
        cache; None: no cache bound known) and sets max_tokens to the room left when unset."""
        bound = self.max_model_len if capacity is None else min(self.max_model_len, capacity)
        room = bound - num_prompt
        if room < 1:
            raise ValueError(f"the prompt's {num_prompt} tokens do not fit the KV cache")
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt} tokens exceeds "
                f"the KV cache capacity of {bound} tokens"
            )

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        max_len = self.max_model_len
        if len(prompt_ids) >= max_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}")
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(prompt_ids)} tokens "
                f"exceeds max_model_len={max_len}"
            )
        if params.stop_token_ids and any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if params.structured_outputs is not None:
            from fleetserve.structured.grammars import check

            check(params.structured_outputs)
