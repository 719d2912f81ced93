"""POST /v1/chat/completions: the tokenizer's chat template, then the same engine path."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.cpu_work import run_cpu
from fleetserve.entrypoints.openai.errors import APIError, from_value_error
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest
from fleetserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    ModelContext,
    ServingContext,
    SSEResponse,
    admit,
    collect,
    finite,
    merged,
    new_id,
    note_request,
    now,
    parse,
    read_body,
    service_class,
    sse,
    sse_error,
    token_text,
    top_entries,
    unless_disconnected,
    usage,
)
from fleetserve.outputs import CompletionOutput, RequestOutput


def _prompt_ids(ctx: ModelContext, req: ChatCompletionRequest) -> list[int]:
    messages = [m.as_template_dict() for m in req.messages]
    try:
        ids = ctx.engine.tokenizer.apply_chat_template(
            messages, req.add_generation_prompt, ctx.engine.max_model_len
        )
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # jinja2 errors: the template refused these messages
        raise APIError(
            400, f"the chat template failed on these messages: {e}", "messages"
        ) from None
    if not ids:
        raise APIError(400, "messages render to an empty prompt", "messages")
    return ids


def chat_inputs(
    ctx: ModelContext, req: ChatCompletionRequest
) -> tuple[dict[str, list[int]], SamplingParams]:
    """The engine prompt and sampling params of a chat request (no HTTP: the batch
    runner calls this too). Raises APIError for what the client got wrong."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    try:
        base = req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise from_value_error(e) from None
    return {"prompt_token_ids": _prompt_ids(ctx, req)}, base


def chat_completion_body(
    ctx: ModelContext, req: ChatCompletionRequest, request_id: str, final: RequestOutput
) -> dict[str, Any]:
    """The non-streaming response body for a finished request."""
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _logprobs(ctx, req, c, 0) if req.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in final.outputs
    ]
    num_completion = sum(len(c.token_ids) for c in final.outputs)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": ctx.served_model_name,
        "choices": choices,
        "usage": usage(len(final.prompt_token_ids), num_completion),
    }


async def create_chat_completion(server: ServingContext, request: Request) -> Response:
    req = parse(ChatCompletionRequest, await read_body(server, request))
    if (cascade := server.cascade(req.model)) is not None:  # serve/pipelines/
        from fleetserve.entrypoints.openai.serving_cascade import create_cascade_chat

        return await create_cascade_chat(request, cascade, req)
    ctx = server.generate_model(req.model)
    class_name = service_class(request, req.service_tier)
    note_request(request, ctx, class_name)
    # The template and the tokenizer take time in proportion to the messages: off the loop.
    prompt, base = await run_cpu(chat_inputs, ctx, req)
    request_id = new_id("chatcmpl")
    streams = await admit(
        request, ctx, request_id, [prompt], lambda: copy.copy(base), req.priority, class_name
    )
    if req.stream:
        return SSEResponse(_stream(ctx, req, request_id, streams))
    (final,) = await unless_disconnected(request, collect(streams))
    return JSONResponse(chat_completion_body(ctx, req, request_id, final))


async def _stream(
    ctx: ModelContext, req: ChatCompletionRequest, request_id: str, streams: list[Any]
) -> AsyncIterator[str]:
    created = now()
    extra = {"usage": None} if req.include_usage else {}

    def chunk(choices: list[Any], more: dict[str, Any] | None = None) -> str:
        body = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": ctx.served_model_name,
            "choices": choices,
            **extra,
            **(more or {}),
        }
        return sse(body)

    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    last: RequestOutput | None = None
    try:
        for i in range(req.n):
            role = {"role": "assistant", "content": ""}
            yield chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
        async for _, out in merged(streams):
            last = out
            for c in out.outputs:
                start_text, start_tok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                delta = c.text[start_text:]
                if delta or len(c.token_ids) > start_tok or c.finish_reason is not None:
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    choice = {
                        "index": c.index,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": _logprobs(ctx, req, c, start_tok) if req.logprobs else None,
                        "finish_reason": c.finish_reason,
                    }
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield chunk([choice])
        if req.include_usage and last is not None:
            num_completion = sum(len(c.token_ids) for c in last.outputs)
            yield chunk([], {"usage": usage(len(last.prompt_token_ids), num_completion)})
    except Exception as e:
        yield sse_error(e)
    finally:
        for s in streams:
            s.close()
    yield SSE_DONE


def _logprobs(
    ctx: ModelContext, req: ChatCompletionRequest, c: CompletionOutput, start_tok: int
) -> dict[str, Any]:
    k = req.top_logprobs or 0

    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = token_text(ctx.engine, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, lps in zip(c.token_ids[start_tok:], (c.logprobs or [])[start_tok:], strict=False):
        item = entry(tid, finite(lps.get(tid)))
        item["top_logprobs"] = [entry(t, lp) for t, lp in top_entries(lps, k)]
        content.append(item)
    return {"content": content}
