"""GraphService: `kind: graph`, a model name served by running its graph (graph_executor.py)
over the models of the fleet. It holds no replica: it is ready when the models its steps
call are, and its metrics count requests per graph and outcome, and steps per node, step
and outcome with their latency. The HTTP side is entrypoints/openai/serving_graph.py.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

from fleetserve.metrics import ModelMetrics
from fleetserve.serve.pipelines.composite import Composite
from fleetserve.serve.pipelines.graph_executor import FleetClient, GraphRun, Trace
from fleetserve.serve.pipelines.graph_plan import GraphPlan

_FAMILIES: dict[int, tuple[Counter, Counter, Histogram]] = {}
OUTCOMES = ("ok", "error", "cancelled")


def _families(metrics: ModelMetrics) -> tuple[Counter, Counter, Histogram]:
    """The graph metric families, one set per server registry."""
    key = id(metrics.registry)
    if key not in _FAMILIES:
        r = metrics.registry
        _FAMILIES[key] = (
            Counter("fleetserve:graph_requests", "Requests a graph answered, by outcome.",
                    ["model_name", "outcome"], registry=r),
            Counter("fleetserve:graph_steps", "Steps of a graph that ran, by node, step and "
                    "outcome.", ["model_name", "node", "step", "outcome"], registry=r),
            Histogram("fleetserve:graph_step_seconds", "Time a graph's step took.",
                      ["model_name", "node", "step"], registry=r),
        )  # fmt: skip
    return _FAMILIES[key]


class GraphService(Composite):
    kind = "graph"

    def __init__(self, plan: GraphPlan, metrics: ModelMetrics) -> None:
        self.name = plan.name
        self.plan = plan
        self.callees: list[Any] = []  # the services its steps call, set by bind()
        self._in_flight = 0
        self._requests, steps, seconds = _families(metrics)
        for outcome in OUTCOMES:
            self._requests.labels(self.name, outcome)
        self._node_of: dict[str, str] = {}
        for node in plan.nodes.values():
            for s in node.steps:
                self._node_of[s.name] = node.name
                seconds.labels(self.name, node.name, s.name)
                for outcome in OUTCOMES:
                    steps.labels(self.name, node.name, s.name, outcome)
        self._steps, self._seconds = steps, seconds

    def bind(self, services: dict[str, Any]) -> None:
        """Takes the services of the models its steps call (the config checked they exist)."""
        names = sorted({s.model for s in self.plan.model_steps() if s.model is not None})
        self.callees = [services[n] for n in names]

    @property
    def answers_generate(self) -> bool:
        return self.plan.answers_generate

    def _observe(self, step: str, outcome: str, seconds: float | None) -> None:
        node = self._node_of[step]
        self._steps.labels(self.name, node, step, outcome).inc()
        if seconds is not None:
            self._seconds.labels(self.name, node, step).observe(seconds)

    def observe_deferred(self, step: str, outcome: str, seconds: float | None) -> None:
        """The last step, run by the HTTP layer (seconds: None for a stream, whose end
        the step does not see)."""
        self._observe(step, outcome, seconds)

    async def run(
        self, client: FleetClient, request: Any, defer_last: bool = False
    ) -> tuple[Any, Trace]:
        """The graph's answer to `request` (None when its last step is deferred) and what
        ran; counts the request (a deferred call's outcome is its stream's)."""
        self._in_flight += 1
        outcome = "error"
        try:
            result = await GraphRun(self.plan, client, request, self._observe).run(defer_last)
            outcome = "ok"
            return result
        except BaseException as e:
            outcome = "error" if isinstance(e, Exception) else "cancelled"
            raise
        finally:
            self._in_flight -= 1
            self._requests.labels(self.name, outcome).inc()

    # ------------------------------------------------------------- ModelService
    @property
    def is_ready(self) -> bool:
        return all(s.is_ready for s in self.callees)

    def card(self) -> dict[str, Any]:
        return {
            "graph": {"root": self.plan.root, "nodes": sorted(self.plan.nodes)},
            "answers": sorted(self.plan.terminal),
        }

    def waiting_by_class(self) -> dict[str, int]:
        return {}
