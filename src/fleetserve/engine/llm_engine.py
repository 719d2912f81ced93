"""LLMEngine: tokenize, validate, step, detokenize, all in the caller's process.

The server drives the same calls (add_request / step / abort_request) from its engine
process; LLM.generate drives them in a loop.
"""

from __future__ import annotations

from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.request import Request
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.core import EngineCore
from fleetserve.engine.output_processor import OutputProcessor
from fleetserve.engine.prompt_rules import PromptRules, PromptType
from fleetserve.engine.stats import EngineStats
from fleetserve.outputs import RequestOutput
from fleetserve.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.config, self.source = args.resolve()
        self.tokenizer = Tokenizer.from_source(self.source)
        self.rules = PromptRules(self.tokenizer, self.config)
        self.core = EngineCore(self.config, self.source)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = tuple(
            sorted(set(self.config.model.eos_token_ids) | set(self.tokenizer.stop_token_ids))
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.rules.tokenize_prompt(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.rules.validate(prompt_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        params = params or SamplingParams()
        text, ids = self.tokenize_prompt(prompt)
        self.validate(ids, params)
        if lora_request is not None:
            # Offline: the adapter is loaded (and checked) before the request is taken.
            self.core.load_lora(lora_request)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        child_ids = self.output_processor.add_request(request_id, text, ids, params)
        try:
            for i, cid in enumerate(child_ids):
                self.core.add_request(
                    Request(
                        cid,
                        ids,
                        params.for_choice(i),
                        eos_token_ids=self.eos_token_ids,
                        priority=priority,
                        arrival_time=arrival_time,
                        group_id=request_id if len(child_ids) > 1 else None,
                        lora_request=lora_request,
                    )
                )
        except ValueError:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            children = self.output_processor.child_ids(rid)
            self.core.abort_requests(children)
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.core.has_unfinished_requests()

    def num_choices(self, request_id: str) -> int:
        """The request's n (its choices); 0 once it is over."""
        return len(self.output_processor.child_ids(request_id))

    def step(self) -> list[RequestOutput]:
        """One engine step; each touched request's delta (outputs.py): what is new since
        its previous one. Fold them (OutputFold) for the whole answer."""
        core_outputs = self.core.step()
        outputs, to_stop = self.output_processor.process(core_outputs)
        if to_stop:
            self.core.stop_requests(to_stop)
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()
