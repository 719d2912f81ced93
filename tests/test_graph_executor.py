"""The graph executor over a recording fleet client: each node type, the mappings between
steps, a seeded splitter, a missing field, a switch with no branch, cancellation, and a
graph in the fleet file checked at load with its key path."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetserve.serve.config.fleet_config import FleetConfig
from fleetserve.serve.pipelines.graph_check import check_graph, terminal_kinds
from fleetserve.serve.pipelines.graph_config import GraphConfig
from fleetserve.serve.pipelines.graph_executor import GraphError, GraphRun
from fleetserve.serve.pipelines.graph_plan import GraphPlan, plan_graph

KINDS = {"e": "embed", "c": "generate", "c2": "generate", "p": "custom"}


class Recorder:
    """Answers each call with a body naming what it got; `hold` makes calls wait."""

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.hold = hold
        self.cancelled = 0

    async def _wait(self) -> None:
        if self.hold is not None:
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    async def chat(self, model: str, messages: list[dict[str, Any]], **p: Any) -> dict[str, Any]:
        self.calls.append(("chat", model, messages))
        await self._wait()
        text = f"{model}:{messages[-1]['content']}"
        return {"object": "chat.completion", "choices": [{"message": {"content": text}}]}

    async def complete(self, model: str, prompt: Any, **p: Any) -> dict[str, Any]:
        self.calls.append(("complete", model, prompt))
        return {"object": "text_completion", "choices": [{"text": f"{model}:{prompt}"}]}

    async def embed(self, model: str, inputs: Any, **p: Any) -> dict[str, Any]:
        self.calls.append(("embed", model, inputs))
        await self._wait()
        return {"data": [{"embedding": [float(len(inputs))]}]}

    async def predict(self, model: str, instances: list[dict[str, Any]]) -> dict[str, Any]:
        self.calls.append(("predict", model, instances))
        return {"predictions": [{"n": len(instances), **i} for i in instances]}


def plan(nodes: dict[str, Any], root: str = "root") -> GraphPlan:
    cfg = GraphConfig.model_validate({"root": root, "nodes": nodes})
    check_graph(0, "g", cfg, KINDS)
    return plan_graph("g", cfg, KINDS, terminal_kinds(cfg, KINDS))


def run(p: GraphPlan, request: Any, client: Recorder | None = None, defer: bool = False) -> Any:
    return asyncio.run(GraphRun(p, client or Recorder(), request).run(defer))


def test_a_sequence_feeds_each_step_and_maps_between_them() -> None:
    p = plan({"root": {"type": "sequence", "steps": [
        {"model": "e", "name": "vec", "input": {"input": "$request.q"}},
        {"model": "c", "input": {"messages": [
            {"role": "user", "content": "{$request.q} {$steps.vec.data[0].embedding}"}]}}]}})  # fmt: skip
    rec = Recorder()
    out, trace = run(p, {"q": "abc"}, rec)
    assert rec.calls[0] == ("embed", "e", "abc")
    assert out["choices"][0]["message"]["content"] == "c:abc [3.0]"
    assert [s["step"] for s in trace.steps] == ["vec", "c"]
    assert all(s["ms"] >= 0 for s in trace.steps)


def test_a_custom_answer_feeds_the_next_custom_model_as_instances() -> None:
    p = plan(
        {"root": {"type": "sequence", "steps": [{"model": "p"}, {"model": "p", "name": "p2"}]}}
    )
    out, _ = run(p, {"instances": [{"x": 1}]})
    assert out == {"predictions": [{"n": 1, "x": 1}]}  # n and x passed through twice


def test_a_switch_takes_the_first_step_whose_condition_holds_else_the_default() -> None:
    p = plan({"root": {"type": "switch", "steps": [
        {"model": "c", "when": "$request.lang == fr"}, {"model": "c2"}]}})  # fmt: skip
    msgs = [{"role": "user", "content": "hi"}]
    fr, trace = run(p, {"lang": "fr", "messages": msgs})
    assert fr["choices"][0]["message"]["content"] == "c:hi" and trace.steps[0]["model"] == "c"
    other, _ = run(p, {"lang": "de", "messages": msgs})
    assert other["choices"][0]["message"]["content"] == "c2:hi"
    strict = plan({"root": {"type": "switch", "steps": [
        {"model": "c", "when": "$request.lang == fr"}, {"model": "c2", "when": "$request.x"}]}})  # fmt: skip
    with pytest.raises(GraphError, match="no step's condition holds"):
        run(strict, {"lang": "de", "messages": msgs})


def test_an_ensemble_runs_its_steps_in_parallel_and_merges_by_name() -> None:
    hold = asyncio.Event()
    p = plan({"root": {"type": "ensemble", "steps": [
        {"model": "e", "input": {"input": "$request.q"}},
        {"model": "c", "input": {"messages": [{"role": "user", "content": "$request.q"}]}}]}})  # fmt: skip

    async def go() -> tuple[Any, Recorder]:
        rec = Recorder(hold)
        task = asyncio.create_task(GraphRun(p, rec, {"q": "ab"}).run())
        while len(rec.calls) < 2:  # both started before either ended: in parallel
            await asyncio.sleep(0.001)
        hold.set()
        return (await task)[0], rec

    out, rec = asyncio.run(go())
    assert set(out) == {"e", "c"} and out["e"]["data"][0]["embedding"] == [2.0]


def shout(request: Any, value: Any, steps: dict[str, Any]) -> dict[str, Any]:
    """A `map:` function (test_graph_executor:shout)."""
    return {"prompt": str(request["q"]).upper()}


def count_keys(merged: dict[str, Any]) -> dict[str, Any]:
    """A `merge:` function (test_graph_executor:count_keys)."""
    return {"steps": sorted(merged)}


def test_map_and_merge_functions_reshape_between_steps() -> None:
    p = plan({"root": {"type": "ensemble", "merge": "test_graph_executor:count_keys", "steps": [
        {"model": "c", "map": "test_graph_executor:shout"},
        {"model": "p", "input": {"instances": [{"q": "$request.q"}]}}]}})  # fmt: skip
    rec = Recorder()
    out, _ = run(p, {"q": "hi"}, rec)
    assert out == {"steps": ["c", "p"]}
    assert ("complete", "c", "HI") in rec.calls


def test_a_seeded_splitter_repeats_its_draws_and_follows_the_weights() -> None:
    nodes = {"root": {"type": "splitter", "seed": 3, "steps": [
        {"model": "c", "weight": 9}, {"model": "c2", "weight": 1}]}}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "x"}]}

    def draws() -> list[str]:
        p = plan(nodes)
        return [run(p, body)[1].steps[0]["model"] for _ in range(200)]

    first = draws()
    assert first == draws()
    assert 150 < first.count("c") < 200 and "c2" in first


def test_a_missing_field_is_a_400_naming_the_step() -> None:
    p = plan({"root": {"type": "sequence", "steps": [
        {"model": "e", "name": "vec", "input": {"input": "$request.q"}}]}})  # fmt: skip
    with pytest.raises(GraphError, match="step 'vec'.*request.q") as e:
        run(p, {"other": 1})
    assert e.value.status == 400


def test_the_last_generate_step_can_be_deferred_for_streaming() -> None:
    p = plan({"root": {"type": "sequence", "steps": [
        {"model": "e", "name": "vec", "input": {"input": "$request.messages[-1].content"}},
        {"model": "c", "input": {"messages": "$request.messages", "max_tokens": 3}}]}})  # fmt: skip
    rec = Recorder()
    body = {"model": "g", "stream": True, "messages": [{"role": "user", "content": "q"}]}
    out, trace = run(p, body, rec, defer=True)
    assert out is None and [c[0] for c in rec.calls] == ["embed"]
    assert trace.deferred is not None and trace.deferred.model == "c"
    assert trace.deferred.body == {"messages": body["messages"], "max_tokens": 3}


def test_cancelling_the_run_cancels_its_steps() -> None:
    p = plan({"root": {"type": "ensemble", "steps": [
        {"model": "e", "input": {"input": "x"}},
        {"model": "c", "input": {"messages": [{"role": "user", "content": "y"}]}}]}})  # fmt: skip

    async def go() -> Recorder:
        rec = Recorder(asyncio.Event())
        task = asyncio.create_task(GraphRun(p, rec, {}).run())
        while len(rec.calls) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return rec

    assert asyncio.run(go()).cancelled == 2


def test_a_graph_in_the_fleet_file_is_checked_with_its_key_path() -> None:
    fleet = {"models": [
        {"name": "c", "model": "/nowhere"},
        {"name": "g", "kind": "graph", "graph": {"root": "a", "nodes": {
            "a": {"type": "sequence", "steps": [{"node": "b"}]},
            "b": {"type": "sequence", "steps": [{"node": "a", "name": "back"}]}}}}]}  # fmt: skip
    with pytest.raises(ValueError, match=r"models\[1\]\.graph\.nodes\.b\.steps\[0\]\.node.*cycle"):
        FleetConfig.model_validate(fleet)
    fleet["models"][1]["graph"] = {"nodes": {"root": {"type": "sequence", "steps": [
        {"model": "nope"}]}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"models\[1\]\.graph\.nodes\.root\.steps\[0\]\.model"):
        FleetConfig.model_validate(fleet)
    with pytest.raises(ValueError, match="graph: for kind 'graph'"):
        FleetConfig.model_validate({"models": [{"name": "c", "model": "/x", "graph": {
            "nodes": {"root": {"type": "sequence", "steps": [{"model": "c"}]}}}}]})  # fmt: skip


GRAPH_FLEET = {"models": [
    {"name": "c", "model": "/nowhere"},
    {"name": "g", "kind": "graph", "graph": {"nodes": {"root": {"type": "sequence",
                                                                 "steps": [{"model": "c"}]}}}}]}  # fmt: skip


def test_ray_serves_a_graph_from_the_ingress(tiny_llama: str) -> None:
    """A graph has no deployment of its own on Ray: the ingress runs it over its clients
    (ray/fleet_client.py); tests/test_pipelines_ray.py serves one."""
    pytest.importorskip("ray")
    from fleetserve.ray.app import build_app

    cfg = dict(GRAPH_FLEET, models=[{"name": "c", "model": tiny_llama}, GRAPH_FLEET["models"][1]])
    app = build_app(FleetConfig.model_validate(cfg))
    handles = app._bound_deployment.init_args[1]  # the ingress's model deployments
    assert sorted(handles) == ["c"]


def test_kubernetes_refuses_a_graph_by_name() -> None:
    from fleetserve.deploy.k8s import RenderOptions, render_fleet

    with pytest.raises(ValueError, match=r"models\[1\]\.kind \(model 'g'\): kind 'graph'"):
        render_fleet(FleetConfig.model_validate(GRAPH_FLEET), RenderOptions())
