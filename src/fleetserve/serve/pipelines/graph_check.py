"""A graph against its fleet, at load: every step's model exists and is one a graph can
call, node references form no cycle and every node is reached from the root, `$steps.NAME`
names a step (an earlier one, within a sequence), and every body fits the model it goes to.

What a value is, as far as the load can tell: "request" (the body the graph was called
with: any shape, checked when it comes), "any" (a part of a value, or what a function
returns), or the output of a model kind: "generate" (a chat.completion or text_completion
body), "embed" (an embeddings list), "custom" (a predictions body), "ensemble" (a merge
keyed by step name). A model takes "request" and "any"; a custom model also takes a custom
model's output (its predictions become the instances); anything else needs a mapping
(`input:` or `map:`), or the graph is refused with the step's key path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetserve.serve.pipelines.graph_config import GraphConfig, NodeConfig, StepConfig
from fleetserve.serve.pipelines.graph_mapping import Selector, selectors_of

CALLABLE_KINDS = ("generate", "embed", "custom")
# The key(s) of the body a model of each kind is called with.
BODY_KEYS: dict[str, tuple[str, ...]] = {
    "generate": ("messages", "prompt"),
    "embed": ("input",),
    "custom": ("instances",),
}


def accepts(model_kind: str, value: str) -> bool:
    if value in ("request", "any"):
        return True
    return model_kind == "custom" and value == "custom"


@dataclass
class _Walk:
    index: int
    name: str
    graph: GraphConfig
    kinds: Mapping[str, str]
    step_names: set[str]
    reached: set[str] = field(default_factory=set)
    outputs: dict[str, str] = field(default_factory=dict)  # step name -> its output's kind

    def fail(self, where: str, message: str) -> ValueError:
        return ValueError(f"models[{self.index}].graph.{where} (model {self.name!r}): {message}")

    def node(self, name: str, value: str, stack: tuple[str, ...]) -> str:
        """The kind of the node's output, given its input's."""
        self.reached.add(name)
        node = self.graph.nodes[name]
        if node.type == "sequence":
            for j, step in enumerate(node.steps):
                value = self.step(name, j, step, value, stack)
            return value
        outs = [self.step(name, j, s, value, stack) for j, s in enumerate(node.steps)]
        if node.type == "ensemble":
            return "any" if node.merge is not None else "ensemble"
        return outs[0] if len(set(outs)) == 1 else "any"

    def step(self, node: str, j: int, step: StepConfig, value: str, stack: tuple[str, ...]) -> str:
        where = f"nodes.{node}.steps[{j}]"
        self._check_refs(node, j, step)
        body = self._body(where, step, value)
        if step.node is not None:
            if step.node not in self.graph.nodes:
                raise self.fail(f"{where}.node", f"no node {step.node!r} in this graph "
                                f"({', '.join(self.graph.nodes)})")  # fmt: skip
            if step.node in (*stack, node):
                cycle = " -> ".join((*stack, node, step.node))
                raise self.fail(f"{where}.node", f"a cycle: {cycle}")
            out = self.node(step.node, body, (*stack, node))
        else:
            assert step.model is not None
            kind = self.kinds.get(step.model)
            if kind is None:
                raise self.fail(f"{where}.model", f"no model {step.model!r} in this fleet")
            if kind not in CALLABLE_KINDS:
                raise self.fail(f"{where}.model", f"{step.model!r} is a {kind} model; a graph "
                                "step calls a generate, embed or custom model")  # fmt: skip
            self._fits(where, step, kind, body)
            out = kind
        self.outputs[step.step_name] = out
        return out

    def _body(self, where: str, step: StepConfig, value: str) -> str:
        """The kind of the body the step sends on: its input's, or its template's."""
        if step.map is not None:
            return "any"
        if step.input is None:
            return value
        if isinstance(step.input, dict):
            return "any"
        if isinstance(step.input, str) and step.input.startswith("$"):
            (sel,) = selectors_of(step.input) or (None,)
            if isinstance(sel, Selector) and sel.whole:
                if sel.root == "request":
                    return "request"
                if sel.root == "input":
                    return value
                return self.outputs.get(str(sel.step), "any")
            return "any"
        raise self.fail(f"{where}.input", "a step's body is a mapping (or a $selector of one)")

    def _fits(self, where: str, step: StepConfig, kind: str, body: str) -> None:
        keys = BODY_KEYS[kind]
        if isinstance(step.input, dict):
            given = [k for k in keys if k in step.input]
            if len(given) != 1:
                wanted = " or ".join(keys)
                raise self.fail(f"{where}.input", f"a {kind} model's body has {wanted}"
                                + (", not both" if given else ""))  # fmt: skip
            return
        if not accepts(kind, body):
            raise self.fail(
                where,
                f"the {body} output that comes here cannot feed the {kind} model "
                f"{step.model!r} as it is; map it with input: {{{keys[0]}: ...}} or "
                "map: 'package.module:function'",
            )

    def _check_refs(self, node: str, j: int, step: StepConfig) -> None:
        sels = selectors_of(step.input) if step.input is not None else []
        steps = self.graph.nodes[node].steps
        for sel in sels:
            name = sel.step
            if name is None:
                continue
            where = f"nodes.{node}.steps[{j}].input"
            if name not in self.step_names:
                raise self.fail(where, f"{sel.text}: no step {name!r} in this graph")
            in_order = self.graph.nodes[node].type == "sequence"
            later = [s.step_name for s in (steps[j:] if in_order else steps)]
            if name in later:
                raise self.fail(where, f"{sel.text}: the step {name!r} has not run yet there")


def check_graph(index: int, name: str, graph: GraphConfig, kinds: Mapping[str, str]) -> None:
    """ValueError with the key path (`models[i].graph.nodes.X.steps[j].model (model 'g')`)."""
    names = {s.step_name for n in graph.nodes.values() for s in n.steps}
    walk = _Walk(index, name, graph, kinds, names)
    walk.node(graph.root, "request", ())
    unreached = [n for n in graph.nodes if n not in walk.reached]
    if unreached:
        raise walk.fail(f"nodes.{unreached[0]}", f"not reached from the root {graph.root!r}")


def terminal_kinds(graph: GraphConfig, kinds: Mapping[str, str]) -> set[str]:
    """The kinds of model whose answer can be the graph's answer ("ensemble": a merge)."""

    def of_node(node: NodeConfig) -> set[str]:
        if node.type == "ensemble":
            return {"ensemble"}
        steps = node.steps[-1:] if node.type == "sequence" else node.steps
        return set().union(*(of_step(s) for s in steps))

    def of_step(step: StepConfig) -> set[str]:
        if step.node is not None:
            return of_node(graph.nodes[step.node])
        return {kinds[str(step.model)]}

    return of_node(graph.nodes[graph.root])
