"""Runs Batch API lines on an engine through the same code as the HTTP handlers.

A chat or completions line is validated by the server's own request models, turned into
a prompt and SamplingParams by the handlers' pure halves (`chat_inputs`,
`completion_inputs`), and answered in the handlers' response shapes, so a batch line
gets exactly what the same body sent to the endpoint would get (minus streaming).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from fleetserve.batch.lines import CHAT_URL, COMPLETIONS_URL, BatchLine
from fleetserve.batch.runner import LineAnswer, LineRetry
from fleetserve.entrypoints.openai.errors import APIError, error_body
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.openai.serving_chat import chat_completion_body, chat_inputs
from fleetserve.entrypoints.openai.serving_common import (
    ServingContext,
    collect,
    new_id,
    parse,
    submit,
)
from fleetserve.entrypoints.openai.serving_completion import completion_body, completion_inputs

log = logging.getLogger(__name__)


class EngineLineExecutor:
    """`LineExecutor` over one engine (an AsyncEngine or anything with its surface).

    `priority`, when given, replaces each line's own: with the engine's `priority`
    scheduling policy, a larger number lets interactive requests go first."""

    def __init__(self, ctx: ServingContext, priority: int | None = None) -> None:
        self.ctx = ctx
        self.priority = priority

    async def __call__(self, line: BatchLine) -> LineAnswer:
        request_id = new_id("chatcmpl" if line.url == CHAT_URL else "cmpl")
        try:
            body = await self._run(line, request_id)
        except APIError as e:
            if e.status == 503 and e.code in ("overloaded", "loading"):
                raise LineRetry(e.message) from None
            if e.status == 503:
                raise  # the engine is gone: nothing can run; the batch resumes later
            return LineAnswer(
                e.status, request_id, error_body(e.status, e.message, e.param, e.code)
            )
        except Exception as e:  # noqa: BLE001 -- one line's failure must not stop the batch
            log.exception("batch line %s failed", line.custom_id)
            return LineAnswer(500, request_id, error_body(500, f"internal error: {e}"))
        return LineAnswer(200, request_id, body)

    async def _run(self, line: BatchLine, request_id: str) -> dict[str, Any]:
        ctx = self.ctx
        if line.body.get("stream"):
            raise APIError(400, "stream is not supported in a batch line", "stream")
        if line.url == CHAT_URL:
            chat = parse(ChatCompletionRequest, line.body)
            prompt, base = chat_inputs(ctx, chat)
            streams = self._submit(request_id, [prompt], base, chat.priority)
            (final,) = await collect(streams)
            return chat_completion_body(ctx, chat, request_id, final)
        if line.url == COMPLETIONS_URL:
            cmpl = parse(CompletionRequest, line.body)
            ctx.check_model(cmpl.model)
            prompts, base = completion_inputs(cmpl)
            streams = self._submit(request_id, prompts, base, cmpl.priority)
            return completion_body(ctx, cmpl, request_id, await collect(streams))
        raise APIError(
            400,
            f"{line.url} is not served by the model {ctx.served_model_name!r} "
            "(it is a generative model)",
            "url",
        )

    def _submit(self, request_id: str, prompts: list[Any], base: Any, priority: int) -> Any:
        chosen = self.priority if self.priority is not None else priority
        return submit(self.ctx, request_id, prompts, lambda: copy.copy(base), chosen)
