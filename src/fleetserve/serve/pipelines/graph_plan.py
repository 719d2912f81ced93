"""A graph's config made ready to run: templates and conditions compiled, functions
imported, each model step's model kind known, a splitter's random source made."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fleetserve.serve.pipelines.graph_config import GraphConfig, NodeConfig, StepConfig
from fleetserve.serve.pipelines.graph_mapping import (
    Condition,
    Template,
    compile_template,
    parse_condition,
)


@dataclass(frozen=True)
class PlanStep:
    node: str  # the node it belongs to
    name: str
    model: str | None
    kind: str | None  # the model's kind: generate | embed | custom
    target: str | None  # the node it runs, for a node step
    input: Template | None
    map: Callable[..., Any] | None
    when: Condition | None
    when_fn: Callable[..., Any] | None
    weight: float | None


@dataclass(frozen=True)
class PlanNode:
    name: str
    type: str
    steps: tuple[PlanStep, ...]
    merge: Callable[[dict[str, Any]], Any] | None
    rng: random.Random | None  # a splitter's


@dataclass(frozen=True)
class GraphPlan:
    name: str
    root: str
    nodes: Mapping[str, PlanNode]
    timeout_s: float | None
    # The kinds of model whose answer can be the graph's answer (graph_check.terminal_kinds).
    terminal: frozenset[str]

    @property
    def answers_generate(self) -> bool:
        """Its last step is always a generate model's: it serves chat and completions."""
        return self.terminal == {"generate"}

    def model_steps(self) -> list[PlanStep]:
        return [s for n in self.nodes.values() for s in n.steps if s.model is not None]


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """'package.module:function' -> the function; ValueError naming `key`."""
    module_name, _, attr = spec.partition(":")
    try:
        fn: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key} {spec!r}: importing {module_name!r} failed: {e}") from None
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{key} {spec!r}: {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{key} {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _step(node: str, j: int, s: StepConfig, kinds: Mapping[str, str]) -> PlanStep:
    key = f"graph.nodes.{node}.steps[{j}]"
    when = parse_condition(s.when) if s.when is not None else None
    return PlanStep(
        node=node,
        name=s.step_name,
        model=s.model,
        kind=kinds[s.model] if s.model is not None else None,
        target=s.node,
        input=compile_template(s.input) if s.input is not None else None,
        map=load_function(s.map, f"{key}.map") if s.map is not None else None,
        when=when,
        when_fn=load_function(when.function, f"{key}.when") if when and when.function else None,
        weight=s.weight,
    )


def _node(name: str, n: NodeConfig, kinds: Mapping[str, str]) -> PlanNode:
    steps = tuple(_step(name, j, s, kinds) for j, s in enumerate(n.steps))
    merge = load_function(n.merge, f"graph.nodes.{name}.merge") if n.merge else None
    rng = random.Random(n.seed) if n.type == "splitter" else None
    return PlanNode(name, n.type, steps, merge, rng)


def plan_graph(
    name: str, cfg: GraphConfig, kinds: Mapping[str, str], terminal: set[str]
) -> GraphPlan:
    """The plan of a graph the fleet config has checked (graph_check.py)."""
    nodes = {n: _node(n, c, kinds) for n, c in cfg.nodes.items()}
    return GraphPlan(name, cfg.root, nodes, cfg.timeout_s, frozenset(terminal))
