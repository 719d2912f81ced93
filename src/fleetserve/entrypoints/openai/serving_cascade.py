"""Chat and completion requests to a cascade (serve/pipelines/cascade.py).

Each tier is tried in turn through the same path a request to that model takes (its
prompt rendered with the tier's own template and tokenizer, then `admit` into the tier's
service with the request's class and priority); the escalation rule judges the answer, or
with decide_after_tokens its first K tokens, held back until then. The response is the
accepted tier's, with its model name in the X-Fleetserve-Tier header and a `fleetserve`
field (in a stream: in the first chunk): {"tier", "escalations": [{"tier", "reason"}]}.
A greedy request that escalates to the last tier gets what that tier alone returns.
With a deadline of its own (X-Fleetserve-Deadline-Ms, deadline.py) the tiers share it:
each runs within what the ones before it left (listed in the `fleetserve` field as
"budget_ms"), and a deadline that passes during a tier is a 504, not an escalation.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetserve.entrypoints.openai.deadline import (
    DeadlineExceeded,
    exceeded,
    remaining_s,
    with_deadline,
)
from fleetserve.entrypoints.openai.serving_common import (
    ModelContext,
    SSEResponse,
    admit,
    collect,
    engine_error,
    note_request,
    service_class,
    sse,
    unless_disconnected,
)
from fleetserve.outputs import RequestOutput
from fleetserve.serve.pipelines.cascade import CascadeService
from fleetserve.serve.pipelines.rules import answer_of
from fleetserve.serve.request_state import FleetStream, RequestState

TIER_HEADER = "X-Fleetserve-Tier"

Inputs = Callable[[ModelContext], Awaitable[tuple[list[Any], Any]]]
Body = Callable[[ModelContext, list[RequestOutput]], dict[str, Any]]
Stream = Callable[[ModelContext, list["_Replay"]], AsyncIterator[str]]


class _Replay:
    """A tier's stream as the client reads it: what was held back while the rule judged
    (`held`: the whole answer so far, one delta from the start), then, when `live`, the
    rest of `source`'s deltas. Its state is `source`'s (which folded every delta, the held
    ones included). `on_end(whole)` is called once, when the reader closes it."""

    def __init__(
        self,
        held: RequestOutput | None,
        source: FleetStream,
        live: bool,
        on_end: Callable[[RequestOutput | None], None],
    ) -> None:
        self.request_id = source.request_id
        self.n = source.n
        self._held, self._source, self._live, self._on_end = held, source, live, on_end
        self._closed = False

    @property
    def state(self) -> RequestState:
        return self._source.state

    def __aiter__(self) -> _Replay:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._held is not None:
            out, self._held = self._held, None
            if out.finished:
                self._live = False
            return out
        if not self._live:
            raise StopAsyncIteration
        return await self._source.__anext__()

    def close(self) -> None:
        self._source.close()
        if not self._closed:
            self._closed = True
            state = self._source.state
            self._on_end(state.fold.output() if state.num_outputs else None)


def _num_tokens(finals: Sequence[RequestOutput | None]) -> int:
    return sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)


def _judge(cascade: CascadeService, tier: str, finals: Sequence[RequestOutput]) -> str | None:
    for f in finals:
        for c in f.outputs:
            reason = cascade.rules.judge(answer_of(tier, c))
            if reason is not None:
                return reason
    return None


async def _first_tokens(streams: Sequence[FleetStream], k: int) -> list[RequestOutput]:
    """Each stream's whole answer so far, once every choice has k tokens or has ended."""
    held = []
    for s in streams:
        async for _ in s:
            whole = s.state.fold.output()
            if all(c.finished or len(c.token_ids) >= k for c in whole.outputs):
                break
        assert s.state.num_outputs
        held.append(s.state.fold.output())
    return held


async def _with_info(chunks: AsyncIterator[str], info: dict[str, Any]) -> AsyncIterator[str]:
    """The stream's chunks, the first one with the `fleetserve` field; closing it closes
    the inner generator (whose cleanup closes the tier's streams)."""
    first = True
    try:
        async for s in chunks:
            if first and s.startswith("data: {"):
                first = False
                body = json.loads(s[len("data: ") :])
                body["fleetserve"] = info
                s = sse(body)
            yield s
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def run_cascade(
    request: Request,
    cascade: CascadeService,
    request_id: str,
    class_name: str | None,
    priority: int,
    streaming: bool,
    inputs: Inputs,
    body: Body,
    stream: Stream,
) -> Response:
    """Tries the tiers in turn and answers with the first accepted one (the last always)."""
    note_request(request, ModelContext(cascade.tiers[0], cascade.name), class_name)
    escalations: list[dict[str, str]] = []
    budgets: list[float] = []
    tier_name = cascade.tiers[0].name
    k = cascade.decide_after_tokens
    cascade.enter()
    handed_over = False  # a stream's end calls leave()
    try:
        for i, tier in enumerate(cascade.tiers):
            tier_name = tier.name
            ctx = ModelContext(tier, cascade.name)
            last = i == len(cascade.tiers) - 1
            left = remaining_s(request)  # what the tiers before it left of the deadline
            if left is not None:
                budgets.append(round(left * 1e3, 1))
                if left <= 0:
                    raise exceeded(request, f"the cascade's tier {tier.name!r}")
            prompts, base = await inputs(ctx)
            if cascade.rules.needs_logprobs and base.logprobs is None and not last:
                base.logprobs = 0  # the rule reads the sampled tokens' logprobs
            streams = await admit(
                request, ctx, f"{request_id}-{i}", prompts, functools.partial(copy.copy, base),
                priority, class_name,
            )  # fmt: skip
            info: dict[str, Any] = {"tier": tier.name, "escalations": escalations}
            if budgets:  # the ms of the request's deadline each tier tried was given
                info["budget_ms"] = budgets
            headers = {TIER_HEADER: tier.name}
            if not streaming or (k is None and not last):
                finals = await unless_disconnected(request, collect(streams))
                cascade.count_tokens(tier.name, _num_tokens(finals))
                reason = None if last else _judge(cascade, tier.name, finals)
                _in_time(request, reason)
                if reason is not None:
                    cascade.count_escalation(tier.name, reason)
                    escalations.append({"tier": tier.name, "reason": reason})
                    continue
                cascade.count_answer(tier.name)
                if not streaming:
                    return JSONResponse({**body(ctx, finals), "fleetserve": info}, headers=headers)
                held: list[RequestOutput | None] = list(finals)
                live = False  # every answer is whole already
            else:
                held = [None] * len(streams)
                if not last:
                    assert k is not None
                    try:
                        held = list(await unless_disconnected(request, _first_tokens(streams, k)))
                    except BaseException:
                        for s in streams:
                            s.close()
                        raise
                    judged = [h for h in held if h is not None]
                    reason = _judge(cascade, tier.name, judged)
                    if reason is not None:
                        for s in streams:
                            s.close()
                        _in_time(request, reason)
                        cascade.count_tokens(tier.name, _num_tokens(held))
                        cascade.count_escalation(tier.name, reason)
                        escalations.append({"tier": tier.name, "reason": reason})
                        continue
                cascade.count_answer(tier.name)
                live = True
            replays = _replays(cascade, tier.name, held, streams, live)
            handed_over = True
            resp = SSEResponse(with_deadline(request, _with_info(stream(ctx, list(replays)), info)))
            resp.headers[TIER_HEADER] = tier.name
            return resp
        raise AssertionError("the last tier is always accepted")
    except DeadlineExceeded:  # during a tier: a 504, never a silent escalation
        raise exceeded(request, f"the cascade's tier {tier_name!r}") from None
    except (ValueError, LookupError) as e:
        raise engine_error(e) from None
    finally:
        if not handed_over:
            cascade.leave()


def _in_time(request: Request, reason: str | None) -> None:
    """An escalation with no deadline left ends the request (a 504 for this tier)."""
    left = remaining_s(request)
    if reason is not None and left is not None and left <= 0:
        raise exceeded(request)


def _replays(
    cascade: CascadeService,
    tier: str,
    held: list[RequestOutput | None],
    sources: Sequence[FleetStream],
    live: bool,
) -> list[_Replay]:
    """The streams the client reads; when the last one ends, the tier's tokens are counted
    and the request leaves the cascade."""
    ends: list[RequestOutput | None] = []

    def on_end(out: RequestOutput | None) -> None:
        ends.append(out)
        if len(ends) == len(held):
            cascade.count_tokens(tier, _num_tokens(ends))
            cascade.leave()

    return [_Replay(h, s, live, on_end) for h, s in zip(held, sources, strict=True)]


async def create_cascade_chat(request: Request, cascade: CascadeService, req: Any) -> Response:
    from fleetserve.cpu_work import run_cpu
    from fleetserve.entrypoints.openai.serving_chat import (
        _stream,
        chat_completion_body,
        chat_inputs,
    )
    from fleetserve.entrypoints.openai.serving_common import new_id

    request_id = new_id("chatcmpl")

    async def inputs(ctx: ModelContext) -> tuple[list[Any], Any]:
        prompt, base = await run_cpu(chat_inputs, ctx, req)
        return [prompt], base

    return await run_cascade(
        request, cascade, request_id, service_class(request, req.service_tier), req.priority,
        bool(req.stream), inputs,
        lambda ctx, finals: chat_completion_body(ctx, req, request_id, finals[0]),
        lambda ctx, streams: _stream(ctx, req, request_id, streams),
    )  # fmt: skip


async def create_cascade_completion(
    request: Request, cascade: CascadeService, req: Any
) -> Response:
    from fleetserve.entrypoints.openai.serving_common import new_id, tokenize_large
    from fleetserve.entrypoints.openai.serving_completion import (
        _stream,
        completion_body,
        completion_inputs,
    )

    request_id = new_id("cmpl")

    async def inputs(ctx: ModelContext) -> tuple[list[Any], Any]:
        prompts, base = completion_inputs(req)
        return await tokenize_large(ctx, prompts), base

    return await run_cascade(
        request, cascade, request_id, service_class(request, req.service_tier), req.priority,
        bool(req.stream), inputs,
        lambda ctx, finals: completion_body(ctx, req, request_id, finals),
        lambda ctx, streams: _stream(ctx, req, request_id, streams),
    )  # fmt: skip
