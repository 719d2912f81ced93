"""Offline API in vLLM's shape: LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.llm_engine import LLMEngine, PromptType
from fleetserve.outputs import OutputFold, RequestOutput
from fleetserve.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base
        model) per prompt; a batch may mix adapters and the base model."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"lora_request has {len(loras)} entries for {len(prompts)} prompts"
                )
        # Validate everything before anything runs, so one bad prompt costs nothing.
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        try:
            for i, (rid, prompt, params) in enumerate(zip(ids, prompts, params_list, strict=True)):
                # Each request owns its params: max_tokens=None is filled per prompt.
                self.engine.add_request(
                    rid,
                    prompt,
                    _copy(params),
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                )
                added.append(rid)
        except Exception:
            self.engine.abort_request(added)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = cast(
            "list[list[dict[str, str]]]",
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        tok = self.engine.tokenizer
        prompts: list[PromptType] = [
            {"prompt_token_ids": tok.apply_chat_template(conv, add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        # The engine yields deltas; each request's are folded into its whole answer.
        folds = {rid: OutputFold(rid, self.engine.num_choices(rid)) for rid in ids}
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    acc = folds[out.request_id]
                    acc.add(out)
                    if out.finished:
                        results[out.request_id] = acc.output()
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _copy(params: SamplingParams) -> SamplingParams:
    import copy

    return copy.copy(params)
