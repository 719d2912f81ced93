"""Runs a graph's plan (graph_plan.py) over a fleet client: each model step is one call of
the client (chat/complete/embed/predict, answering the HTTP endpoint's JSON body as a
dict), so the same graph runs wherever a client exists: GatewayFleetClient on the local
server (each call through the callee's own service, with the request's class), a client
over Ray Serve deployment handles on Ray.

Node types: `sequence` (each step's output is the next one's input), `switch` (the first
step whose `when:` holds, the last one without a condition as the default; none holding
and no default: 400), `ensemble` (the steps in parallel, merged into {step: output} or by
`merge:`), `splitter` (one step drawn by weight; a `seed:` makes the draws repeatable).

With `defer_last`, the step that gives the graph's answer (a generate model's) is not
called: run() returns it as a DeferredCall (model, body) for the HTTP layer to stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetserve.serve.pipelines.graph_mapping import MissingValue, Scope
from fleetserve.serve.pipelines.graph_plan import GraphPlan, PlanNode, PlanStep

# Keys of a graph's request body that belong to the call of the graph, not to its steps.
_CALL_KEYS = ("model", "stream", "stream_options")


class FleetClient(Protocol):
    """What a handler or a graph step calls other models with: each returns the JSON body
    the HTTP endpoint would return, as a dict, and raises an error with `status` (the HTTP
    status the endpoint would answer; FleetCallError) when it fails. Every backend keeps
    it (entrypoints/openai/fleet_client.py's GatewayFleetClient, the handler process's
    ProcFleetClient)."""

    async def chat(
        self, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> dict[str, Any]: ...

    async def complete(self, model: str, prompt: Any, **params: Any) -> dict[str, Any]: ...

    async def embed(self, model: str, inputs: Any, **params: Any) -> dict[str, Any]: ...

    async def predict(self, model: str, instances: list[dict[str, Any]]) -> dict[str, Any]: ...


class GraphError(ValueError):
    """The request cannot run through the graph (a missing field, no switch branch): a 4xx
    with `status` (400 unless a sub-call said otherwise)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class DeferredCall:
    """The graph's last step, left to the caller (to stream it)."""

    step: str
    model: str
    body: dict[str, Any]


@dataclass
class Trace:
    """The steps that ran, in the order they ended: {"step", "model"|"node", "ms"}."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    deferred: DeferredCall | None = None


StepObserver = Callable[[str, str, float], None]  # (step, outcome, seconds)


def default_body(kind: str, value: Any) -> dict[str, Any]:
    """The body a model of `kind` gets when its step has no mapping."""
    if not isinstance(value, dict):
        raise GraphError(f"a {kind} step got {type(value).__name__}, not a JSON object; "
                         "map it with input:")  # fmt: skip
    if kind == "custom" and "predictions" in value and "instances" not in value:
        return {"instances": value["predictions"]}  # a custom model's answer
    return {k: v for k, v in value.items() if k not in _CALL_KEYS}


async def call_model(client: FleetClient, model: str, kind: str, body: dict[str, Any]) -> Any:
    """One model step through the client, by the model's kind and the body's keys."""
    body = dict(body)
    if kind == "generate":
        if "messages" in body:
            return await client.chat(model, body.pop("messages"), **body)
        if "prompt" in body:
            return await client.complete(model, body.pop("prompt"), **body)
        raise GraphError(f"the generate step to {model!r} got no messages or prompt")
    if kind == "embed":
        if "input" not in body:
            raise GraphError(f"the embed step to {model!r} got no input")
        return await client.embed(model, body.pop("input"), **body)
    if "instances" not in body:
        raise GraphError(f"the custom step to {model!r} got no instances")
    return await client.predict(model, body["instances"])


class GraphRun:
    """One request through a graph."""

    def __init__(
        self,
        plan: GraphPlan,
        client: FleetClient,
        request: Any,
        observe: StepObserver | None = None,
    ) -> None:
        self.plan, self.client, self.request = plan, client, request
        self.outputs: dict[str, Any] = {}
        self.trace = Trace()
        self._observe = observe

    async def run(self, defer_last: bool = False) -> tuple[Any, Trace]:
        out = await self._node(self.plan.nodes[self.plan.root], self.request, defer_last)
        return out, self.trace

    async def _node(self, node: PlanNode, value: Any, defer: bool) -> Any:
        if node.type == "sequence":
            for j, step in enumerate(node.steps):
                value = await self._step(step, value, defer and j == len(node.steps) - 1)
            return value
        if node.type == "ensemble":
            outs = await asyncio.gather(*(self._step(s, value, False) for s in node.steps))
            merged = {s.name: o for s, o in zip(node.steps, outs, strict=True)}
            return node.merge(merged) if node.merge is not None else merged
        return await self._step(self._choose(node, value), value, defer)

    def _choose(self, node: PlanNode, value: Any) -> PlanStep:
        if node.type == "splitter":
            assert node.rng is not None
            weights = [s.weight or 0.0 for s in node.steps]
            return node.rng.choices(node.steps, weights=weights)[0]
        scope = Scope(self.request, value, self.outputs)
        for step in node.steps:
            if step.when is None or step.when.holds(scope, step.when_fn):
                return step
        conditions = "; ".join(s.when.text for s in node.steps if s.when is not None)
        raise GraphError(f"graph {self.plan.name!r}, node {node.name!r}: no step's condition "
                         f"holds for this request ({conditions}) and there is no default")  # fmt: skip

    def _body(self, step: PlanStep, value: Any) -> Any:
        scope = Scope(self.request, value, self.outputs)
        try:
            if step.map is not None:
                return step.map(self.request, value, dict(self.outputs))
            return step.input(scope) if step.input is not None else value
        except MissingValue as e:
            raise GraphError(f"graph {self.plan.name!r}, step {step.name!r}: {e}") from None

    async def _step(self, step: PlanStep, value: Any, defer: bool) -> Any:
        body = self._body(step, value)
        start = time.monotonic()
        if step.target is not None:
            out = await self._node(self.plan.nodes[step.target], body, defer)
            self._done(step, {"node": step.target}, start, "ok")
            self.outputs[step.name] = out
            return out
        assert step.model is not None and step.kind is not None
        if defer and step.kind == "generate":
            call = default_body("generate", body)
            self.trace.deferred = DeferredCall(step.name, step.model, call)
            self.trace.steps.append({"step": step.name, "model": step.model, "ms": None})
            return None
        outcome = "error"
        try:
            out = await call_model(
                self.client, step.model, step.kind, default_body(step.kind, body)
            )
            outcome = "ok"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if outcome != "ok":
                self._done(step, {"model": step.model}, start, outcome)
        self._done(step, {"model": step.model}, start, outcome)
        self.outputs[step.name] = out
        return out

    def _done(self, step: PlanStep, what: dict[str, Any], start: float, outcome: str) -> None:
        took = time.monotonic() - start
        entry = {"step": step.name, **what, "ms": round(took * 1e3, 3)}
        if outcome != "ok":
            entry["outcome"] = outcome
        self.trace.steps.append(entry)
        if self._observe is not None:
            self._observe(step.name, outcome, took)
