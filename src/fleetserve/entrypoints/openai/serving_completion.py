"""POST /v1/completions (the legacy text completions API)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.entrypoints.openai.access_log import note_metadata
from fleetserve.entrypoints.openai.deadline import with_deadline
from fleetserve.entrypoints.openai.errors import APIError, from_value_error
from fleetserve.entrypoints.openai.protocol import MAX_N, CompletionRequest
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
    tokenize_large,
    top_entries,
    unless_disconnected,
    usage,
)
from fleetserve.entrypoints.openai.structured import from_structured_outputs
from fleetserve.outputs import CompletionOutput, Logprobs, RequestOutput
from fleetserve.serve.request_state import StatefulStream


def _prompts(prompt: Any) -> list[Any]:
    """One engine prompt per entry: a string, or {"prompt_token_ids": [...]}."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [{"prompt_token_ids": ids} for ids in prompt]


def completion_inputs(req: CompletionRequest) -> tuple[list[Any], SamplingParams]:
    """The engine prompts and sampling params of a completions request (no HTTP: the
    batch runner calls this too). Raises APIError for what the client got wrong."""
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n)", "best_of")
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > MAX_N:
        raise APIError(400, f"len(prompt) * n must be at most {MAX_N}", "prompt")
    echo_lps = req.logprobs if req.echo and req.logprobs is not None else None
    constraint = from_structured_outputs(req.structured_outputs)
    try:
        base = req.sampling_params(req.max_tokens, req.logprobs, echo_lps, constraint)
    except ValueError as e:
        raise from_value_error(e) from None
    return prompts, base


async def create_completion(server: ServingContext, request: Request) -> Response:
    raw = await read_body(server, request)
    if (graph := server.graph(raw.get("model"))) is not None:  # serve/pipelines/graph_*.py
        from fleetserve.entrypoints.openai.serving_graph import graph_generate

        return await graph_generate(request, server.registry, graph, raw, chat=False)
    req = parse(CompletionRequest, raw)
    if (cascade := server.cascade(req.model)) is not None:  # serve/pipelines/
        from fleetserve.entrypoints.openai.serving_cascade import create_cascade_completion

        return await create_cascade_completion(request, cascade, req)
    ctx = server.generate_model(req.model)
    class_name = service_class(request, req.service_tier)
    note_request(request, ctx, class_name)
    note_metadata(request, req.metadata)
    prompts, base = completion_inputs(req)
    prompts = await tokenize_large(ctx, prompts)
    request_id = new_id("cmpl")
    streams = await admit(
        request, ctx, request_id, prompts, lambda: copy.copy(base), req.priority, class_name
    )
    if req.stream:
        return SSEResponse(with_deadline(request, _stream(ctx, req, request_id, streams)))
    finals = await unless_disconnected(request, collect(streams))
    return JSONResponse(completion_body(ctx, req, request_id, finals))


def completion_body(
    ctx: ModelContext, req: CompletionRequest, request_id: str, finals: list[RequestOutput]
) -> dict[str, Any]:
    """The non-streaming response body for finished requests (one per prompt)."""
    choices = []
    num_prompt = num_completion = 0
    for i, out in enumerate(finals):
        num_prompt += len(out.prompt_token_ids)
        prompt_text = _prompt_text(ctx, out) if req.echo else ""
        for c in out.outputs:
            num_completion += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = _logprobs(ctx, req, out, c, 0, include_prompt=req.echo)
            choices.append(
                {
                    "index": i * req.n + c.index,
                    "text": prompt_text + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": ctx.served_model_name,
        "choices": choices,
        "usage": usage(num_prompt, num_completion),
    }


async def _stream(
    ctx: ModelContext, req: CompletionRequest, request_id: str, streams: Sequence[StatefulStream]
) -> AsyncIterator[str]:
    created = now()
    # Per choice: characters already sent (after the echoed prompt) and tokens generated.
    sent_chars: dict[int, int] = {}
    num_prompt: dict[int, int] = {}
    num_completion: dict[int, int] = {}
    extra = {"usage": None} if req.include_usage else {}
    try:
        async for i, out in merged(streams):
            num_prompt[i] = len(out.prompt_token_ids)
            for c in out.outputs:  # the choices this delta changed: their new text and tokens
                index = i * req.n + c.index
                first = index not in sent_chars
                prefix = _prompt_text(ctx, out) if first and req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    echoed = len(_prompt_text(ctx, out)) if req.echo and not first else 0
                    offset = echoed + sent_chars.get(index, 0)
                    prompt_lps = streams[i].state.fold.prompt_logprobs
                    logprobs = _logprobs(ctx, req, out, c, offset, first and req.echo, prompt_lps)
                sent_chars[index] = sent_chars.get(index, 0) + len(c.text)
                num_completion[index] = num_completion.get(index, 0) + len(c.token_ids)
                choice = {
                    "index": index,
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                yield sse(_chunk(ctx, request_id, created, [choice], extra))
        if req.include_usage:
            u = usage(sum(num_prompt.values()), sum(num_completion.values()))
            yield sse(_chunk(ctx, request_id, created, [], {"usage": u}))
    except Exception as e:
        yield sse_error(e)
    finally:
        for s in streams:
            s.close()
    yield SSE_DONE


def _chunk(
    ctx: ModelContext, request_id: str, created: int, choices: list[Any], extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.served_model_name,
        "choices": choices,
        **extra,
    }


def _prompt_text(ctx: ModelContext, out: RequestOutput) -> str:
    if out.prompt is not None:
        return out.prompt
    return ctx.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def _logprobs(
    ctx: ModelContext,
    req: CompletionRequest,
    out: RequestOutput,
    c: CompletionOutput,
    text_offset: int,
    include_prompt: bool,
    prompt_logprobs: list[Logprobs | None] | None = None,
) -> dict[str, Any]:
    """OpenAI's completions logprobs for `c`'s tokens (a delta's new ones, or a whole
    answer's), plus the prompt's on echo (`prompt_logprobs`, default `out`'s)."""
    k = req.logprobs or 0
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = text_offset

    def add(tid: int, lps: Logprobs | None) -> None:
        nonlocal pos
        text = token_text(ctx.engine, tid)
        tokens.append(text)
        token_lps.append(finite(lps.get(tid)) if lps else None)
        tops.append(
            {token_text(ctx.engine, t): lp for t, lp in top_entries(lps, k)} if lps else None
        )
        offsets.append(pos)
        pos += len(text)

    if include_prompt:
        plps = (prompt_logprobs if prompt_logprobs is not None else out.prompt_logprobs) or []
        for j, tid in enumerate(out.prompt_token_ids):
            add(tid, plps[j] if j < len(plps) else None)
    for tid, lps in zip(c.token_ids, c.logprobs or [], strict=False):
        add(tid, lps)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
