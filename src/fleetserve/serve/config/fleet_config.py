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

A generate model may instead of `replicas` run in pools of spot and on-demand capacity
(serve/replicas/pool_plan.py keeps them at their targets, SpotHedge-style; on Ray, ray/pool_deployments.py):

        pools:
          - {name: spot, capacity: spot, replicas: 3, overprovision: 1,
             notice: {provider: aws}}
          - {name: base, capacity: on_demand, replicas: 1, max_fallback: 3}

and a class may be pinned to spot capacity (`batch: {priority: 10, capacity: spot}`).

A gateway's generate model may instead be served by other fleetserve servers (pods,
serve/remote/replica.py): `remote: {urls: [http://10.0.0.7:8000, ...]}` or `remote: {dns:
chat-pods.llm.svc:8000, refresh_s: 10}`; `model` and `engine` then describe the pods'
model (the gateway tokenizes), and `replicas` / `pools` are left out.

On Ray Serve (`fleetserve serve --ray`) a model may instead of `replicas` say
`autoscale: {min_replicas, max_replicas, target_queue_depth, upscale_delay_s,
downscale_delay_s}`, and `placement: {num_cpus, memory_gb, resources,
max_replicas_per_node, spot_resource, on_demand_resource, spot_pending_s, spot_labels,
on_demand_labels}`; the local
server refuses both rather than ignore them. Ray refuses a pool's `notice` (local server
only).

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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from fleetserve.cloud.notices import NoticeConfig
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.lora.config import parse_lora_modules
from fleetserve.serve.admission.sla import ServiceClass
from fleetserve.serve.config.deploy_config import DeployConfig
from fleetserve.serve.microbatch.batcher import MicroBatchConfig
from fleetserve.serve.pipelines.cascade_config import EscalateConfig, check_cascade, check_tiers
from fleetserve.serve.pipelines.graph_check import check_graph
from fleetserve.serve.pipelines.graph_config import GraphConfig, check_graph_keys
from fleetserve.serve.routing.policies import POLICY_NAMES

ModelKind = Literal["generate", "embed", "custom", "cascade", "graph"]
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


class ClassConfig(_Strict):
    """`oversubscribe`: how many batches (`max_num_seqs`) of this class's and more important
    sequences a replica takes; above 1 the surplus waits in the engine's own queue and
    fills a finished sequence's slot on the next step (throughput for `batch`). More
    important classes keep their seats, and the engine's priority order, untouched."""

    priority: int = Field(default=0, ge=0, le=1_000_000)
    max_waiting: int = Field(default=256, ge=0)
    max_queue_time_s: float | None = Field(default=None, gt=0.0)
    hedge_after_s: float | None = Field(default=None, gt=0.0)
    oversubscribe: float = Field(default=1.0, ge=1.0, le=64.0)
    # "spot": routed to spot replicas only (work that can wait out a preemption, e.g. batch).
    capacity: Literal["any", "spot"] = "any"


class PoolConfig(_Strict):
    """One pool of a model's replicas. `replicas` is the pool's target. A spot pool runs
    `overprovision` more than that, so a preemption usually leaves the target standing; an
    on-demand pool may start up to `max_fallback` more while spot is short of its target."""

    name: str
    capacity: Literal["spot", "on_demand"]
    replicas: int = Field(ge=0, le=64)
    overprovision: int = Field(default=0, ge=0, le=64)
    max_fallback: int = Field(default=0, ge=0, le=64)
    notice: NoticeConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: no spaces or control characters")
        if self.capacity == "on_demand":
            if self.overprovision:
                raise ValueError("overprovision is for spot pools (on-demand is not preempted)")
            if self.notice is not None:
                raise ValueError("notice is for spot pools (on-demand is not preempted)")
        elif self.max_fallback:
            raise ValueError("max_fallback is for on_demand pools (spot is what falls back)")
        return self

    @property
    def is_spot(self) -> bool:
        return self.capacity == "spot"


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
    `max_replicas_per_node` of them on one node (1 spreads them over the nodes).

    With `pools`, a spot pool's replicas ask for a little of the custom resource
    `spot_resource` and an on-demand pool's of `on_demand_resource`, so that they run only
    on nodes started with it (`ray start --resources '{"spot": 1}'`). A spot replica that
    Serve cannot run (its node was preempted and no spot node is left to place it on) for
    `spot_pending_s` makes on-demand replicas fill in (ray/pool_deployments.py). `spot_labels` /
    `on_demand_labels` select the nodes by Ray node labels instead of the resource (Ray's
    `label_selector`, e.g. `{"ray.io/market-type": "spot"}`)."""

    num_cpus: float = Field(default=1.0, ge=0.0)
    memory_gb: float | None = Field(default=None, gt=0.0)
    resources: dict[str, float] = Field(default_factory=dict)
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    spot_resource: str = "spot"
    on_demand_resource: str = "on_demand"
    spot_pending_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    spot_labels: dict[str, str] | None = Field(default=None, min_length=1)
    on_demand_labels: dict[str, str] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> PlacementConfig:
        for key in ("spot_resource", "on_demand_resource"):
            value = getattr(self, key)
            if not _NAME.match(value) or value in ("CPU", "GPU", "memory"):
                raise ValueError(f"{key} {value!r}: a custom resource name, no spaces")
        if self.spot_resource == self.on_demand_resource:
            raise ValueError("spot_resource and on_demand_resource must differ")
        return self


class ResilienceConfig(_Strict):
    """How a generate model survives losing replicas (serve/resilience/migration.py, model_service.py).

    A request whose replica dies, is drained or hangs is resumed on another replica, at
    most `migration_limit` times (0: never; it then fails), waiting up to
    `migration_wait_s` for one to be up. A replica that dies is replaced
    (`replace_failed`); one that holds work and runs no engine step for `hang_timeout_s`
    is declared hung, its requests move and it is killed and replaced. A preemption
    notice (SIGTERM to its process, a cloud's spot notice) drains it: short requests
    finish, the rest move, all before the notice's deadline; SIGTERM gives
    `sigterm_grace_s`."""

    migration_limit: int = Field(default=3, ge=0, le=100)
    migration_wait_s: float = Field(default=60.0, ge=0.0)
    replace_failed: bool = True
    hang_timeout_s: float | None = Field(default=60.0, gt=0.0)
    sigterm_grace_s: float = Field(default=15.0, gt=0.0, le=3600.0)


# What a pod does with its own engines (SIGTERM grace, replacing a dead one): a `remote:`
# model's gateway has no engine to apply them to, so it refuses them.
POD_RESILIENCE_KEYS = ("sigterm_grace_s", "replace_failed")


class RemoteConfig(_Strict):
    """A gateway's generate model served by other fleetserve servers (pods): `urls`, or a
    `dns` name (host:port, e.g. a headless Service) whose addresses are re-resolved every
    `refresh_s`. With `api_key_env`, the gateway sends the key held in that environment
    variable to the pods (the file never holds the key itself). The pods may be at zero
    (a name that lists none, URLs that do not answer yet): requests wait for one, up to
    the model's `resilience.migration_wait_s` (serve/admission/replica_wait.py)."""

    urls: list[str] | None = Field(default=None, min_length=1, max_length=64)
    dns: str | None = None
    refresh_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    scheme: Literal["http", "https"] = "http"
    api_key_env: str | None = None
    poll_interval_s: float = Field(default=0.5, gt=0.0, le=60.0)

    @model_validator(mode="after")
    def _check(self) -> RemoteConfig:
        if (self.urls is None) == (self.dns is None):
            raise ValueError("give urls or dns (one of them)")
        for url in self.urls or []:
            if not re.match(r"^https?://[^\s/]+:\d+/?$", url):
                raise ValueError(f"urls: {url!r}: expected http://host:port")
        if len(set(self.urls or [])) != len(self.urls or []):
            raise ValueError("urls: each pod once")
        if self.dns is not None and not re.match(r"^[A-Za-z0-9.-]+:\d+$", self.dns):
            raise ValueError(f"dns {self.dns!r}: expected SERVICE.NAMESPACE.svc:PORT")
        return self


ToolParserName = Literal["hermes", "qwen", "llama3_json", "mistral", "json"]


class ModelEntry(_Strict):
    name: str
    kind: ModelKind = "generate"
    model: str | None = None
    replicas: int = Field(default=1, ge=1, le=64)
    routing: RoutingName = "least_loaded"
    engine: EngineFields | None = None  # type: ignore[valid-type]
    batching: MicroBatchConfig | None = None
    handler: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    # A custom handler's process (serve/microbatch/isolated.py): a call past timeout_s is
    # ended (504) and the process restarted; memory_limit_mb caps its heap.
    timeout_s: float | None = Field(default=None, gt=0.0, le=86_400.0)
    memory_limit_mb: int | None = Field(default=None, ge=16)
    deploy: DeployConfig | None = None  # read by `fleetserve deploy k8s` only
    autoscale: AutoscaleConfig | None = None
    placement: PlacementConfig | None = None
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)
    pools: list[PoolConfig] | None = Field(default=None, min_length=1)
    # Served by other fleetserve servers; `model` and `engine` still describe the model
    # (the gateway tokenizes and validates), and should match the pods'.
    remote: RemoteConfig | None = None
    # How tool calls are read from this model's output (generate models); by default
    # what its chat template implies (entrypoints/openai/tool_parsers).
    tool_parser: ToolParserName | None = None
    # LoRA adapters of a generate model, name -> PEFT folder; each is served under its
    # name (implies the engine's enable_lora; engine: max_loras etc. size the slots).
    adapters: dict[str, str] | None = None

    @field_validator("adapters")
    @classmethod
    def _check_adapters(cls, adapters: dict[str, str] | None) -> dict[str, str] | None:
        for name, path in (adapters or {}).items():
            if not _NAME.match(name):
                raise ValueError(f"adapter name {name!r}: no spaces or control characters")
            if not path:
                raise ValueError(f"adapter {name!r}: the path is empty")
        return adapters

    # kind cascade (serve/pipelines/): its tiers, cheapest first, and when to go up a tier.
    tiers: list[str] | None = None
    escalate: EscalateConfig | None = None
    decide_after_tokens: int | None = Field(default=None, ge=1)
    # kind graph (serve/pipelines/graph_*.py): its nodes and their steps.
    graph: GraphConfig | None = None

    @field_validator("pools")
    @classmethod
    def _check_pools(cls, pools: list[PoolConfig] | None) -> list[PoolConfig] | None:
        if pools is None:
            return None
        names = [p.name for p in pools]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(dups)}")
        if sum(p.replicas for p in pools) < 1:
            raise ValueError("the pools' replicas add up to 0: at least one replica is needed")
        total = sum(p.replicas + p.overprovision + p.max_fallback for p in pools)
        if total > 64:
            raise ValueError(
                f"replicas + overprovision + max_fallback add up to {total}; at most 64"
            )
        if any(p.is_spot for p in pools) and not any(
            p.replicas + p.max_fallback > 0 for p in pools if not p.is_spot
        ):
            raise ValueError(
                "spot pools need an on_demand pool to fall back on (replicas or max_fallback "
                "> 0): spot replicas can be preempted, or not granted, all at once"
            )
        return pools

    @model_validator(mode="after")
    def _check_kind(self) -> ModelEntry:
        if self.pools is not None:
            if self.kind != "generate":
                raise ValueError(f"pools is for generate models, not {self.kind!r}")
            if "replicas" in self.model_fields_set:
                raise ValueError("give replicas or pools, not both (each pool has replicas)")
            if self.autoscale is not None:
                raise ValueError("give autoscale or pools, not both")
        if self.remote is not None:
            if self.kind != "generate":
                raise ValueError(f"remote is for generate models, not {self.kind!r}")
            given = [k for k in ("replicas", "pools", "autoscale", "placement")
                     if k in self.model_fields_set]  # fmt: skip
            if given:
                raise ValueError(f"remote lists the replicas; leave out {', '.join(given)}")
            pod_only = [f"resilience.{k}" for k in POD_RESILIENCE_KEYS
                        if k in self.resilience.model_fields_set]  # fmt: skip
            if pod_only:
                raise ValueError(
                    f"{', '.join(pod_only)}: a remote model's pods stop and replace their own "
                    "engines; set it in the pods' fleet file, not the gateway's"
                )
        if self.autoscale is not None and "replicas" in self.model_fields_set:
            raise ValueError("give replicas or autoscale, not both (autoscale starts at min)")
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: no spaces or control characters")
        check_cascade(self.kind, self.tiers, self.escalate, self.decide_after_tokens)
        check_graph_keys(self.kind, self.graph)
        if self.kind == "custom":
            if self.handler is None or not re.match(r"^[\w.]+:[\w.]+$", self.handler):
                raise ValueError("a custom model needs handler: 'package.module:ClassName'")
        elif self.handler is not None or self.options:
            raise ValueError(f"handler and options are for kind 'custom', not {self.kind!r}")
        else:
            limits = [k for k in ("timeout_s", "memory_limit_mb") if getattr(self, k) is not None]
            if limits:
                raise ValueError(f"{', '.join(limits)}: for kind 'custom', not {self.kind!r}")
        if self.kind == "generate" and self.batching is not None:
            raise ValueError("batching is for embed and custom models (generate batches itself)")
        if self.kind != "generate" and self.tool_parser is not None:
            raise ValueError(f"tool_parser is for generate models, not {self.kind!r}")
        if self.kind != "generate" and self.adapters:
            raise ValueError(f"adapters is for generate models, not {self.kind!r}")
        if self.kind != "generate" and self.engine is not None:
            raise ValueError(f"engine is for generate models, not {self.kind!r}")
        if self.kind != "generate" and "resilience" in self.model_fields_set:
            raise ValueError(f"resilience is for generate models, not {self.kind!r}")
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
        if self.adapters:
            modules = dict(parse_lora_modules(fields.get("lora_modules")))
            fields["lora_modules"] = {**modules, **self.adapters}
            fields["enable_lora"] = True
        return EngineArgs(model=self.model, **fields)

    def replica_plan(self) -> list[PoolConfig]:
        """The model's pools; without `pools`, one on-demand pool named "default" of
        `replicas`, so that the code past the config always sees pools."""
        if self.pools is not None:
            return list(self.pools)
        return [PoolConfig(name="default", capacity="on_demand", replicas=self.replicas)]

    @property
    def has_spot(self) -> bool:
        return any(p.is_spot for p in self.replica_plan())


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
        adapter_names = [a for m in self.models for a in (m.adapters or {})]
        clash = sorted({a for a in adapter_names if adapter_names.count(a) > 1 or a in names})
        if clash:
            raise ValueError(
                f"adapter names must be unique and differ from model names: {', '.join(clash)}"
            )
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
        kinds = {m.name: m.kind for m in self.models}
        for i, m in enumerate(self.models):
            if m.tiers is not None:
                check_tiers(i, m.name, m.tiers, kinds)
            if m.graph is not None:
                check_graph(i, m.name, m.graph, kinds)
        pinned = sorted(self.spot_only_classes())
        for i, m in enumerate(self.models):
            if pinned and m.kind == "generate" and not m.has_spot:
                # Its requests of that class could never be routed: refused, not queued forever.
                raise ValueError(
                    f"classes.{pinned[0]}.capacity is 'spot' but models[{i}] ({m.name!r}) "
                    "has no spot pool"
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

    def spot_only_classes(self) -> frozenset[str]:
        """The classes routed to spot replicas only (serve/replicas/pool_plan.py's prefer_spot)."""
        return frozenset(name for name, c in self.classes.items() if c.capacity == "spot")

    def service_classes(self) -> dict[str, ServiceClass]:
        return {
            name: ServiceClass(
                name,
                c.priority,
                c.max_waiting,
                c.max_queue_time_s,
                hedge_after_s=c.hedge_after_s,
                oversubscribe=c.oversubscribe,
            )  # fmt: skip
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


_EXTRA_KEY = "Extra inputs are not permitted"


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
            if err["type"] == "unexpected_keyword_argument":
                msg = _EXTRA_KEY  # a dataclass section's unknown key reads as a model's does
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
    resilience: dict[str, Any] | None = None,
    oversubscribe: float = 1.0,
    tool_parser: str | None = None,
) -> FleetConfig:
    """`fleetserve serve` without --config: one generate model, one class (`default`),
    the engine exactly as its flags say (fcfs unless --scheduling-policy priority).
    `fleetserve batch run`, whose one class is all batch work, oversubscribes it."""
    fields = dataclasses.asdict(args)
    model = fields.pop("model")
    entry = {"name": name, "model": model, "replicas": replicas, "routing": routing}
    if resilience is not None:
        entry["resilience"] = resilience
    if tool_parser is not None:
        entry["tool_parser"] = tool_parser
    return parse_fleet_config(
        {
            "models": [{**entry, "engine": fields}],
            "classes": {"default": {"max_waiting": max_waiting, "oversubscribe": oversubscribe}},
        },
        "the command line",
    )
