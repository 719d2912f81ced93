"""Runs Batch API lines on the fleet through the same code as the HTTP handlers.

A line's body is validated by the server's own request models, its model is found in the
registry by name (404 unknown, 400 wrong kind, as over HTTP), it is turned into prompts
and SamplingParams by the handlers' pure halves (`chat_inputs`, `completion_inputs`) and
answered in the handlers' response shapes (`chat_completion_body`, `completion_body`,
`create_embedding`), so a batch line gets what the same body sent to the endpoint would
get, minus streaming.

Generate lines are admitted in the `batch` service class when the model has one (the
fleet file's classes: a low priority, a large queue), else in the model's default class.
A class queue that is full or a model still loading answers "not now" (LineRetry): batch
lines wait for room and never displace interactive traffic.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from fleetserve.batch.lines import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, BatchLine
from fleetserve.batch.runner import LineAnswer, LineRetry
from fleetserve.cpu_work import run_cpu
from fleetserve.entrypoints.openai.errors import APIError, error_body
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.openai.protocol_embed import EmbeddingRequest
from fleetserve.entrypoints.openai.serving_chat import chat_completion_body, chat_inputs
from fleetserve.entrypoints.openai.serving_common import (
    ModelContext,
    ServingContext,
    collect,
    engine_error,
    new_id,
    parse,
    tokenize_large,
)
from fleetserve.entrypoints.openai.serving_completion import completion_body, completion_inputs
from fleetserve.entrypoints.openai.serving_embedding import create_embedding
from fleetserve.outputs import RequestOutput
from fleetserve.serve.microbatch.services import EmbedService

log = logging.getLogger(__name__)

BATCH_CLASS = "batch"
_PREFIX = {CHAT_URL: "chatcmpl", COMPLETIONS_URL: "cmpl", EMBEDDINGS_URL: "embd"}


class FleetLineExecutor:
    """`LineExecutor` over the fleet's registry (every model the server serves)."""

    def __init__(self, server: ServingContext, class_name: str = BATCH_CLASS) -> None:
        self.server = server
        self.class_name = class_name

    async def __call__(self, line: BatchLine) -> LineAnswer:
        request_id = new_id(_PREFIX.get(line.url, "req"))
        try:
            body = await self._run(line, request_id)
        except APIError as e:
            if e.status == 503 and e.code != "engine_unavailable":
                raise LineRetry(e.message) from None  # full class queue, still loading
            if e.status == 503:
                raise  # the model is gone: nothing can run; the batch resumes later
            return LineAnswer(
                e.status, request_id, error_body(e.status, e.message, e.param, e.code)
            )
        except Exception as e:  # noqa: BLE001 -- one line's failure must not stop the batch
            log.exception("batch line %s failed", line.custom_id)
            return LineAnswer(500, request_id, error_body(500, f"internal error: {e}"))
        return LineAnswer(200, request_id, body)

    async def _run(self, line: BatchLine, request_id: str) -> dict[str, Any]:
        if line.body.get("stream"):
            raise APIError(400, "stream is not supported in a batch line", "stream")
        if line.url == CHAT_URL:
            chat = parse(ChatCompletionRequest, line.body)
            ctx = self.server.generate_model(chat.model)
            self._check_tier(ctx, chat.service_tier)
            prompt, base = await run_cpu(chat_inputs, ctx, chat)
            (final,) = await self._generate(ctx, request_id, [prompt], base, chat.priority)
            return chat_completion_body(ctx, chat, request_id, final)
        if line.url == COMPLETIONS_URL:
            cmpl = parse(CompletionRequest, line.body)
            ctx = self.server.generate_model(cmpl.model)
            self._check_tier(ctx, cmpl.service_tier)
            prompts, base = completion_inputs(cmpl)
            prompts = await tokenize_large(ctx, prompts)
            finals = await self._generate(ctx, request_id, prompts, base, cmpl.priority)
            return completion_body(ctx, cmpl, request_id, finals)
        assert line.url == EMBEDDINGS_URL, line.url  # lines.parse_line admits no other
        emb = parse(EmbeddingRequest, line.body)
        service = self.server.model(emb.model, "embed")
        assert isinstance(service, EmbedService)
        return await create_embedding(service, emb)

    @staticmethod
    def _check_tier(ctx: ModelContext, service_tier: str | None) -> None:
        """A line's service_tier is checked as over HTTP (a class the model lacks: 400),
        though the line still runs in the batch class: batch work never takes the seats
        of interactive traffic."""
        if service_tier in (None, "auto", "default"):
            return
        try:
            ctx.engine.queue.resolve(service_tier)
        except ValueError as e:
            raise APIError(400, str(e), "service_tier") from None

    async def _generate(
        self, ctx: ModelContext, request_id: str, prompts: list[Any], base: Any, priority: int
    ) -> list[RequestOutput]:
        service = ctx.engine
        cls = self.class_name if self.class_name in service.queue.classes else None
        try:
            streams = await service.admit(
                request_id, prompts, lambda: copy.copy(base), cls, priority,
                lora_name=ctx.lora_name,
            )  # fmt: skip
        except Exception as e:
            raise engine_error(e) from None
        return await collect(streams)
