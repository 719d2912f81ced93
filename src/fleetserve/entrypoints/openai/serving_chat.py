"""POST /v1/chat/completions: the tokenizer's chat template, then the same engine path."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.cpu_work import run_cpu
from fleetserve.entrypoints.openai.access_log import note_metadata
from fleetserve.entrypoints.openai.deadline import with_deadline
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
from fleetserve.entrypoints.openai.structured import (
    combined,
    from_response_format,
    from_structured_outputs,
)
from fleetserve.entrypoints.openai.tools import (
    ChoiceDeltas,
    ToolPlan,
    message_and_reason,
    plan_tools,
    template_messages,
    template_renders_tools,
)
from fleetserve.outputs import CompletionOutput, RequestOutput
from fleetserve.serve.request_state import StatefulStream


def _prompt_ids(ctx: ModelContext, req: ChatCompletionRequest) -> list[int]:
    tok = ctx.engine.tokenizer
    renders = template_renders_tools(tok.chat_template)
    messages = template_messages([m.as_template_dict() for m in req.messages], req.tools, renders)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and renders else None
    try:
        ids = tok.apply_chat_template(
            messages, req.add_generation_prompt, tools, max_model_len=ctx.engine.max_model_len
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


def tool_plan(ctx: ModelContext, req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool mode (None: no tools); 400s for bad tools or tool_choice."""
    return plan_tools(
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        ctx.tool_parser,
        ctx.engine.tokenizer.chat_template,
    )


def chat_inputs(
    ctx: ModelContext, req: ChatCompletionRequest
) -> tuple[dict[str, list[int]], SamplingParams]:
    """The engine prompt and sampling params of a chat request (no HTTP: the batch
    runner calls this too). Raises APIError for what the client got wrong."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    plan = tool_plan(ctx, req)
    constraint = combined(
        ("response_format", from_response_format(req.response_format)),
        ("structured_outputs", from_structured_outputs(req.structured_outputs)),
        ("tool_choice", plan.structured if plan is not None else None),
    )
    try:
        base = req.sampling_params(max_tokens, logprobs, structured_outputs=constraint)
    except ValueError as e:
        raise from_value_error(e) from None
    if plan is not None and plan.parser is not None and plan.parser.needs_special_tokens:
        base.skip_special_tokens = False
    return {"prompt_token_ids": _prompt_ids(ctx, req)}, base


def chat_completion_body(
    ctx: ModelContext, req: ChatCompletionRequest, request_id: str, final: RequestOutput
) -> dict[str, Any]:
    """The non-streaming response body for a finished request."""
    plan = tool_plan(ctx, req)
    choices = []
    for c in final.outputs:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason = c.finish_reason
        if plan is not None:
            message, reason = message_and_reason(plan, c.text, c.finish_reason)
        message.setdefault("refusal", None)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": _logprobs(ctx, req, c) if req.logprobs else None,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
        )
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
    raw = await read_body(server, request)
    if (graph := server.graph(raw.get("model"))) is not None:  # serve/pipelines/graph_*.py
        from fleetserve.entrypoints.openai.serving_graph import graph_generate

        return await graph_generate(request, server.registry, graph, raw, chat=True)
    req = parse(ChatCompletionRequest, raw)
    if (cascade := server.cascade(req.model)) is not None:  # serve/pipelines/
        from fleetserve.entrypoints.openai.serving_cascade import create_cascade_chat

        return await create_cascade_chat(request, cascade, req)
    ctx = server.generate_model(req.model)
    class_name = service_class(request, req.service_tier)
    note_request(request, ctx, class_name)
    note_metadata(request, req.metadata)
    # The template and the tokenizer take time in proportion to the messages: off the loop.
    prompt, base = await run_cpu(chat_inputs, ctx, req)
    request_id = new_id("chatcmpl")
    streams = await admit(
        request, ctx, request_id, [prompt], lambda: copy.copy(base), req.priority, class_name
    )
    if req.stream:
        return SSEResponse(with_deadline(request, _stream(ctx, req, request_id, streams)))
    (final,) = await unless_disconnected(request, collect(streams))
    return JSONResponse(chat_completion_body(ctx, req, request_id, final))


async def _stream(
    ctx: ModelContext,
    req: ChatCompletionRequest,
    request_id: str,
    streams: Sequence[StatefulStream],
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

    # Per choice: the deltas to send (content, or tool calls); the role rides with a
    # choice's first chunk, as vLLM sends it, so a client timing the first chunk measures
    # the real time to first token.
    deltas = [ChoiceDeltas(tool_plan(ctx, req)) for _ in range(req.n)]
    started: set[int] = set()
    try:
        async for _, out in merged(streams):
            for c in out.outputs:  # the choices this delta changed: their new text and tokens
                finished = c.finish_reason is not None
                delta = deltas[c.index].add(c.text, finished)
                if not (delta or (req.logprobs and c.token_ids) or finished):
                    continue
                if c.index not in started:
                    started.add(c.index)
                    delta = {"role": "assistant", "content": "", **delta}
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": _logprobs(ctx, req, c) if req.logprobs else None,
                    "finish_reason": deltas[c.index].finish_reason(c.finish_reason),
                }
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
        (state,) = (s.state for s in streams)
        if req.include_usage and state.num_outputs:
            u = usage(len(state.fold.prompt_token_ids), state.fold.num_generated)
            yield chunk([], {"usage": u})
    except Exception as e:
        yield sse_error(e)
    finally:
        for s in streams:
            s.close()
    yield SSE_DONE


def _logprobs(ctx: ModelContext, req: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any]:
    """The logprobs of `c`'s tokens (a delta's new ones, or a whole answer's)."""
    k = req.top_logprobs or 0

    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = token_text(ctx.engine, tid)
        return {"token": text, "logprob": lp, "bytes": list(ctx.engine.tokenizer.token_bytes(tid))}

    content = []
    for tid, lps in zip(c.token_ids, c.logprobs or [], strict=False):
        item = entry(tid, finite(lps.get(tid)))
        item["top_logprobs"] = [entry(t, lp) for t, lp in top_entries(lps, k)]
        content.append(item)
    return {"content": content}
