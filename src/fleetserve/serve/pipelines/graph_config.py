"""The fleet file's keys of a `kind: graph` model, in the spirit of KServe's InferenceGraph:

    - name: rag
      kind: graph
      graph:
        root: main                   # the node a request enters (default "root")
        timeout_s: 30                # the whole graph's deadline (504 past it); optional
        nodes:
          main:
            type: sequence           # sequence | switch | ensemble | splitter
            steps:
              - {name: vec, model: minilm, input: {input: "$request.messages[-1].content"}}
              - {name: docs, model: retriever, input: {instances: ["$steps.vec.data[0]"]}}
              - model: chat
                input:
                  messages:
                    - {role: system, content: "Answer from: {$steps.docs.predictions[0]}"}
                    - "$request.messages[-1]"

A step calls a `model:` of the fleet (generate, embed or custom) or runs another `node:`;
its body is its `input:` template (graph_mapping.py) or what `map: package.module:function`
returns (called with request, input, steps), else its default input unchanged. `when:`
(switch) picks the step, `weight:` (splitter) weighs it; an ensemble's outputs merge into
{step name: output}, or through `merge: package.module:function`; a splitter with `seed:`
draws its sequence of choices from that seed (tests). Checked here alone (keys, syntax),
then against the fleet in graph_check.py (models exist, no cycles, types fit).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetserve.serve.pipelines.graph_mapping import (
    is_function,
    parse_condition,
    parse_selector,
    selectors_of,
)

NodeType = Literal["sequence", "switch", "ensemble", "splitter"]
_FUNCTION_FORM = "'package.module:function'"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StepConfig(_Strict):
    name: str | None = None  # default: the model's or the node's name
    model: str | None = None
    node: str | None = None
    input: Any = None
    map: str | None = None
    when: str | None = None
    weight: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> StepConfig:
        if (self.model is None) == (self.node is None):
            raise ValueError("a step names one of model (a model of the fleet) or node")
        if self.input is not None and self.map is not None:
            raise ValueError("give input (a template) or map (a function), not both")
        if self.map is not None and not is_function(self.map):
            raise ValueError(f"map {self.map!r}: expected {_FUNCTION_FORM}")
        if self.input is not None:
            try:
                selectors_of(self.input)
            except ValueError as e:
                raise ValueError(f"input: {e}") from None
        if self.when is not None:
            try:
                parse_condition(self.when)
            except ValueError as e:
                raise ValueError(f"when: {e}") from None
        return self

    @property
    def step_name(self) -> str:
        name = self.name or self.model or self.node
        assert name is not None
        return name


class NodeConfig(_Strict):
    type: NodeType
    steps: list[StepConfig] = Field(min_length=1)
    merge: str | None = None  # ensemble
    seed: int | None = None  # splitter

    @model_validator(mode="after")
    def _check(self) -> NodeConfig:
        t = self.type
        for j, s in enumerate(self.steps):
            if s.when is not None and t != "switch":
                raise ValueError(f"steps[{j}].when: for a switch node, not a {t}")
            if s.weight is not None and t != "splitter":
                raise ValueError(f"steps[{j}].weight: for a splitter node, not a {t}")
            if t == "splitter" and s.weight is None:
                raise ValueError(f"steps[{j}].weight: every step of a splitter has a weight")
            if t == "switch" and s.when is None and j != len(self.steps) - 1:
                raise ValueError(f"steps[{j}].when: only the last step of a switch may go "
                                 "without a condition (the default)")  # fmt: skip
        if self.merge is not None:
            if t != "ensemble":
                raise ValueError(f"merge: for an ensemble node, not a {t}")
            if not is_function(self.merge):
                raise ValueError(f"merge {self.merge!r}: expected {_FUNCTION_FORM}")
        if self.seed is not None and t != "splitter":
            raise ValueError(f"seed: for a splitter node, not a {t}")
        return self


class GraphConfig(_Strict):
    root: str = "root"
    nodes: dict[str, NodeConfig] = Field(min_length=1)
    timeout_s: float | None = Field(default=None, gt=0.0, le=86_400.0)

    @field_validator("nodes")
    @classmethod
    def _check_names(cls, nodes: dict[str, NodeConfig]) -> dict[str, NodeConfig]:
        for name in nodes:
            try:
                parse_selector(f"$steps.{name}")
            except ValueError:
                raise ValueError(f"node name {name!r}: letters, digits, _ and -") from None
        return nodes

    @model_validator(mode="after")
    def _check(self) -> GraphConfig:
        if self.root not in self.nodes:
            raise ValueError(f"root {self.root!r} is not one of the nodes "
                             f"({', '.join(self.nodes)})")  # fmt: skip
        seen: dict[str, str] = {}
        for node_name, node in self.nodes.items():
            for j, s in enumerate(node.steps):
                where = f"nodes.{node_name}.steps[{j}]"
                try:
                    parse_selector(f"$steps.{s.step_name}")
                except ValueError:
                    raise ValueError(f"{where}.name {s.step_name!r}: a step's name is letters, "
                                     "digits, _ and - (name it with name:)") from None  # fmt: skip
                if s.step_name in seen:
                    raise ValueError(
                        f"{where}: the step name {s.step_name!r} is also {seen[s.step_name]}'s; "
                        "step names are unique in a graph ($steps.NAME reads them): give it "
                        "name:"
                    )
                seen[s.step_name] = where
        return self


def check_graph_keys(kind: str, graph: GraphConfig | None) -> None:
    """A model entry's graph key, alone (graph_check.py checks it against the fleet)."""
    if kind != "graph" and graph is not None:
        raise ValueError(f"graph: for kind 'graph', not {kind!r}")
    if kind == "graph" and graph is None:
        raise ValueError("graph: a graph model needs its graph (nodes and their steps)")
