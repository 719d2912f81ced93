"""The fleet file (`fleetserve serve --config fleet.yaml`), validated before anything loads.

    models:
      - name: chat                 # the name clients send as "model"
        kind: generate             # generate | embed | custom
        model: null                # path; null = the default SmolLM2
        replicas: 2
        routing: prefix_affinity
        engine: {max_num_seqs: 32, num_threads: 1}
      - name: minilm
        kind: embed
        model: all-MiniLM-L6-v2
        batching: {max_batch_size: 32, batch_wait_timeout_s: 0.01}
      - name: classifier
        kind: custom
        handler: mypkg.vision:Classifier
        options: {threshold: 0.5}          # keyword arguments of the handler's __init__
        batching: {max_batch_size: 8, batch_wait_timeout_s: 0.02}
    classes:
      interactive: {priority: 0, max_waiting: 64, max_queue_time_s: 5}
      batch: {priority: 10, max_waiting: 100000, oversubscribe: 2}
    default_class: interactive

On Ray Serve (`fleetserve serve --ray`) a model may instead of `replicas` say
`autoscale: {min_replicas, max_replicas, target_queue_depth, upscale_delay_s,
downscale_delay_s}`, and `placement: {num_cpus, memory_gb, resources,
max_replicas_per_node}`; the local server refuses both rather than ignore them.

Unknown keys and bad values are refused with the key's path (`models[0].engine.max_num_seqs`).
`engine:` takes EngineArgs' fields; the model list's `model` is EngineArgs.model. A fleet
defaults its generate engines to the "priority" scheduling policy, so that the classes'
order reaches the engine's scheduler (it preempts less important classes first).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.serve.deploy_config import DeployConfig
from fleetserve.serve.policies import POLICY_NAMES
from fleetserve.serve.sla import ServiceClass

ModelKind = Literal["generate", "embed", "custom"]
MODEL_KINDS: tuple[str, ...] = typing.get_args(ModelKind)
RoutingName = Literal["round_robin", "least_loaded", "prefix_affinity", "power_of_two"]
assert set(typing.get_args(RoutingName)) == set(POLICY_NAMES)

# A name travels in JSON bodies, headers and metric labels: no spaces or control characters.
_NAME = re.compile(r"^[^\s\x00-\x1f\x7f]+$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _engine_fields_model() -> type[BaseModel]:
    """EngineArgs' fields as a pydantic model (one definition: the dataclass)."""
    hints = typing.get_type_hints(EngineArgs)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue  # given once, as the model entry's `model`
        default = "priority" if f.name == "scheduling_policy" else f.default
        fields[f.name] = (hints[f.name], default)
    return create_model("EngineFields", __config__=_Strict.model_config, **fields)


EngineFields = _engine_fields_model()


class BatchingConfig(_Strict):
    """serve/batcher.py's BatchingConfig, checked here with the key's path."""

    max_batch_size: int = Field(default=32, ge=1, le=4096)
    batch_wait_timeout_s: float = Field(default=0.01, ge=0.0, le=3600.0)
    max_waiting: int = Field(default=4096, ge=1)


class ClassConfig(_Strict):
    """`oversubscribe`: how many batches (`max_num_seqs`) of this class's and more important
    sequences a replica takes; above 1 the surplus waits in the engine's own queue and
    fills a finished sequence's slot on the next step (throughput for `batch`). More
    important classes keep their seats, and the engine's priority order, untouched."""

    priority: int = Field(default=0, ge=0, le=1_000_000)
    max_waiting: int = Field(default=256, ge=0)
    max_queue_time_s: float | None = Field(default=None, gt=0.0)
    oversubscribe: float = Field(default=1.0, ge=1.0, le=64.0)


class AutoscaleConfig(_Strict):
    """Replicas follow queue depth (Ray Serve only: `fleetserve serve --ray`). A replica is
    sized for a batch (`max_num_seqs`) running plus `target_queue_depth` waiting; see
    fleetserve/ray/autoscale.py for the policy. min_replicas 0 scales to zero."""

    min_replicas: int = Field(default=1, ge=0, le=1024)
    max_replicas: int = Field(default=4, ge=1, le=1024)
    target_queue_depth: float = Field(default=4.0, gt=0.0)
    upscale_delay_s: float = Field(default=5.0, ge=0.0)
    downscale_delay_s: float = Field(default=60.0, ge=0.0)

    @model_validator(mode="after")
    def _check(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self


class PlacementConfig(_Strict):
    """Where a model's replicas run (Ray Serve only): Ray resources per replica, and at most
    `max_replicas_per_node` of them on one node (1 spreads them over the nodes)."""

    num_cpus: float = Field(default=1.0, ge=0.0)
    memory_gb: float | None = Field(default=None, gt=0.0)
    resources: dict[str, float] = Field(default_factory=dict)
    max_replicas_per_node: int | None = Field(default=None, ge=1)


class ModelEntry(_Strict):
    name: str
    kind: ModelKind = "generate"
    model: str | None = None
    replicas: int = Field(default=1, ge=1, le=64)
    routing: RoutingName = "least_loaded"
    engine: EngineFields | None = None  # type: ignore[valid-type]
    batching: BatchingConfig | None = None
    handler: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    deploy: DeployConfig | None = None  # read by `fleetserve deploy k8s` only
    autoscale: AutoscaleConfig | None = None
    placement: PlacementConfig | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> ModelEntry:
        if self.autoscale is not None and "replicas" in self.model_fields_set:
            raise ValueError("give replicas or autoscale, not both (autoscale starts at min)")
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: no spaces or control characters")
        if self.kind == "custom":
            if self.handler is None or not re.match(r"^[\w.]+:[\w.]+$", self.handler):
                raise ValueError("a custom model needs handler: 'package.module:ClassName'")
        elif self.handler is not None or self.options:
            raise ValueError(f"handler and options are for kind 'custom', not {self.kind!r}")
        if self.kind == "generate" and self.batching is not None:
            raise ValueError("batching is for embed and custom models (generate batches itself)")
        if self.kind != "generate" and self.engine is not None:
            raise ValueError(f"engine is for generate models, not {self.kind!r}")
        if self.kind != "generate" and self.routing != "least_loaded":
            raise ValueError(f"routing is for generate models, not {self.kind!r}")
        if self.kind != "generate" and self.replicas != 1:
            # One batcher per model in the API process; replicas of it are not built yet.
            raise ValueError(f"replicas is for generate models, not {self.kind!r}")
        return self

    def engine_args(self) -> EngineArgs:
        """The EngineArgs of one replica (generate models)."""
        fields = (
            self.engine.model_dump() if self.engine is not None else EngineFields().model_dump()
        )
        return EngineArgs(model=self.model, **fields)


class FleetConfig(_Strict):
    models: list[ModelEntry] = Field(min_length=1)
    classes: dict[str, ClassConfig] = Field(default_factory=lambda: {"default": ClassConfig()})
    default_class: str | None = None

    @model_validator(mode="after")
    def _check(self) -> FleetConfig:
        names = [m.name for m in self.models]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dups)}")
        if not self.classes:
            raise ValueError("classes: at least one class is needed")
        for name in self.classes:
            if not _NAME.match(name):
                raise ValueError(f"classes: name {name!r}: no spaces or control characters")
        factors: dict[int, tuple[str, float]] = {}
        for name, c in self.classes.items():
            other = factors.setdefault(c.priority, (name, c.oversubscribe))
            if other[1] != c.oversubscribe:
                raise ValueError(
                    f"classes: {other[0]!r} and {name!r} share priority {c.priority} (and so "
                    "a replica's seats) but not oversubscribe; give them the same one"
                )
        if self.default_class is None and len(self.classes) > 1:
            raise ValueError("default_class is required when there is more than one class")
        if self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(
                f"default_class {self.default_class!r} is not one of the classes "
                f"({', '.join(sorted(self.classes))})"
            )
        return self

    def ray_only_keys(self) -> list[str]:
        """The keys only `fleetserve serve --ray` honours, where this fleet sets them."""
        return [
            f"models[{i}].{key}"
            for i, m in enumerate(self.models)
            for key in ("autoscale", "placement")
            if getattr(m, key) is not None
        ]

    @property
    def default_class_name(self) -> str:
        return self.default_class or next(iter(self.classes))

    def service_classes(self) -> dict[str, ServiceClass]:
        return {
            name: ServiceClass(name, c.priority, c.max_waiting, c.max_queue_time_s, c.oversubscribe)
            for name, c in self.classes.items()
        }


def _path(data: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """('models', 0, 'engine', 'x') -> "models[0].engine.x (model 'chat')"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in part:  # pydantic's own steps, e.g. 'function-after[...]', are not keys
            out += f".{part}" if out else part
    models = data.get("models")
    if len(loc) > 1 and loc[0] == "models" and isinstance(loc[1], int) and isinstance(models, list):
        entry = models[loc[1]] if loc[1] < len(models) else None
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            out += f" (model {entry['name']!r})"
    return out or "(top level)"


def parse_fleet_config(data: Any, source: str = "fleet config") -> FleetConfig:
    """A FleetConfig from parsed YAML/JSON; ValueError naming every bad key's path."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with a 'models' list at the top")
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{_path(data, tuple(err['loc']))}: {msg}")
        raise ValueError(f"{source}: " + "; ".join(lines)) from None


def load_fleet_config(path: str) -> FleetConfig:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    return parse_fleet_config(data, path)


def single_model_fleet(
    name: str,
    args: EngineArgs,
    replicas: int,
    routing: str,
    max_waiting: int,
    oversubscribe: float = 1.0,
) -> FleetConfig:
    """`fleetserve serve` without --config: one generate model, one class (`default`),
    the engine exactly as its flags say (fcfs unless --scheduling-policy priority).
    `fleetserve batch run`, whose one class is all batch work, oversubscribes it."""
    fields = dataclasses.asdict(args)
    model = fields.pop("model")
    entry = {"name": name, "model": model, "replicas": replicas, "routing": routing}
    return parse_fleet_config(
        {
            "models": [{**entry, "engine": fields}],
            "classes": {"default": {"max_waiting": max_waiting, "oversubscribe": oversubscribe}},
        },
        "the command line",
    )
