"""GET /dashboard/api/snapshot: the fleet at this moment, as the dashboard page draws it.

Read from the server's own metrics registry (the `fleetserve:` series, structured, not
scraped text) and its services (which models, kinds, classes, replicas and their pools).
Rates are over the last `RATE_WINDOW_S` seconds, percentiles over `LATENCY_WINDOW_S`;
running totals (requests, migrations, replica events) since the server started.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from fleetserve.entrypoints.openai.dashboard.window import History, Totals, Window, read_totals
from fleetserve.metrics import ServerMetrics

RATE_WINDOW_S = 10.0
LATENCY_WINDOW_S = 60.0
_NS = "fleetserve:"
_LATENCIES = {
    "ttft": _NS + "time_to_first_token_seconds",
    "tpot": _NS + "time_per_output_token_seconds",
    "e2e": _NS + "e2e_request_latency_seconds",
}
_REQUESTS = _NS + "http_requests_total"


@runtime_checkable
class ServiceView(Protocol):
    """What the snapshot reads of every model's service (serve/services/service_registry.py ModelService)."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    def waiting_by_class(self) -> dict[str, int]: ...


@runtime_checkable
class HasReplicaViews(Protocol):
    """A generate model served here (GenerateService): its replicas with pool and state."""

    def replica_views(self) -> list[dict[str, Any]]: ...


class Snapshots:
    """Builds snapshots; one per server, since it keeps the totals' recent history."""

    def __init__(
        self,
        metrics: ServerMetrics,
        services: Iterable[ServiceView],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.services = list(services)
        self.clock = clock
        self.history = History(horizon_s=LATENCY_WINDOW_S)

    def take(self) -> dict[str, Any]:
        now = read_totals(self.metrics.registry, self.clock())
        self.history.add(now)
        rates = self.history.window(now, RATE_WINDOW_S)
        latencies = self.history.window(now, LATENCY_WINDOW_S)
        models = [_model(s, now, rates, latencies) for s in self.services]
        return {
            "time": time.time(),
            "rate_window_s": _r(rates.seconds),
            "latency_window_s": _r(latencies.seconds),
            "fleet": _fleet(models),
            "models": models,
        }


def _model(service: ServiceView, now: Totals, rates: Window, lat: Window) -> dict[str, Any]:
    name = service.name
    waiting = service.waiting_by_class()
    classes = [_class(name, c, n, now, rates, lat) for c, n in waiting.items()]
    dead = service.dead_reason
    view: dict[str, Any] = {
        "name": name,
        "kind": service.kind,
        "state": _state(service, dead),
        "dead_reason": dead,
        "requests_total": now.total(_REQUESTS, model_name=name),
        "errors_total": _errors(now.select(_REQUESTS, {"model_name": name})),
        "requests_per_s": _r(rates.rate(_REQUESTS, model_name=name)),
        "errors_per_s": _r(sum(c["errors_per_s"] or 0.0 for c in classes))
        if rates.seconds > 0
        else None,
        "waiting": sum(waiting.values()),
        "classes": classes,
        "migrations": _by(now, _NS + "request_migrations_total", name, "reason"),
        "replica_events": _by(now, _NS + "replica_events_total", name, "event"),
        "finished": _by(now, _NS + "request_success_total", name, "finished_reason"),
    }
    if service.kind == "generate":
        queries = rates.increase(_NS + "replica_prefix_cache_queries_total", model_name=name)
        hits = rates.increase(_NS + "replica_prefix_cache_hits_total", model_name=name)
        view.update(
            prompt_tokens_per_s=_r(rates.rate(_NS + "prompt_tokens_total", model_name=name)),
            generation_tokens_per_s=_r(
                rates.rate(_NS + "generation_tokens_total", model_name=name)
            ),
            generation_tokens_total=now.total(_NS + "generation_tokens_total", model_name=name),
            running=now.total(_NS + "num_requests_running", model_name=name),
            kv_cache_usage=_r(now.total(_NS + "kv_cache_usage_perc", model_name=name)),
            prefix_cache_hit_rate=_r(hits / queries) if queries > 0 else None,
            replicas=_replicas(service, now),
        )
    else:
        view.update(
            batches_per_s=_r(rates.rate(_NS + "batch_size_count", model_name=name)),
            batch_size_p50=_r(lat.quantile(0.5, _NS + "batch_size", model_name=name)),
            batch_seconds_p99=_r(
                lat.quantile(0.99, _NS + "batch_duration_seconds", model_name=name)
            ),
            replicas=[],
        )
    return view


def _class(
    model: str, name: str, waiting: int, now: Totals, rates: Window, lat: Window
) -> dict[str, Any]:
    match = {"model_name": model, "class": name}
    view: dict[str, Any] = {
        "name": name,
        "waiting": waiting,
        "requests_total": now.total(_REQUESTS, **match),
        "requests_per_s": _r(rates.rate(_REQUESTS, **match)),
        "errors_per_s": None,
        "shed_total": now.total(_NS + "requests_shed_total", **match),
    }
    if rates.seconds > 0:
        statuses = {labels["status"] for labels, _, _ in now.select(_REQUESTS, match)}
        errors = sum(rates.increase(_REQUESTS, **match, status=s) for s in statuses if _is_error(s))
        view["errors_per_s"] = _r(errors / rates.seconds)
    for key, histogram in _LATENCIES.items():
        view[key] = {
            "p50": _r(lat.quantile(0.5, histogram, **match)),
            "p99": _r(lat.quantile(0.99, histogram, **match)),
        }
    return view


def _replicas(service: ServiceView, now: Totals) -> list[dict[str, Any]]:
    """The admin API's view of each replica (pool, capacity, state, pid) with its series."""
    name = service.name
    series: dict[str, dict[str, float]] = {}
    for suffix in ("healthy", "outstanding_requests", "step_latency_seconds",
                   "prefix_cache_hit_rate", "straggler"):  # fmt: skip
        for labels, _, value in now.select(f"{_NS}replica_{suffix}", {"model_name": name}):
            series.setdefault(labels["replica"], {})[suffix] = value
    views = service.replica_views() if isinstance(service, HasReplicaViews) else []
    if not isinstance(service, HasReplicaViews):
        # Ray: the replicas its router lists (Serve routes only to healthy ones), no pools.
        for figures in series.values():
            figures.setdefault("healthy", 1.0)
        indices = sorted(int(i) for i in series if i.isdigit())
        views = [{"index": i, "state": "ready" if series[str(i)]["healthy"] else "unhealthy"}
                 for i in indices]  # fmt: skip
    out = []
    for v in views:
        s = series.get(str(v.get("index")), {})
        out.append(
            {
                "index": v.get("index"),
                "pool": v.get("pool"),
                "capacity": v.get("capacity"),
                "state": v.get("state"),
                "pid": v.get("pid"),
                "healthy": bool(s.get("healthy", 0.0)),
                "straggler": bool(s.get("straggler", 0.0)),
                "num_requests": v.get("num_requests", s.get("outstanding_requests")),
                # The series says 0 before a replica's first step: no figure yet.
                "step_latency_s": _r(s.get("step_latency_seconds") or None),
                "prefix_cache_hit_rate": _r(s.get("prefix_cache_hit_rate")),
            }
        )
    return out


def _fleet(models: list[dict[str, Any]]) -> dict[str, Any]:
    replicas = [r for m in models for r in m["replicas"]]
    return {
        "num_models": len(models),
        "num_replicas": len(replicas),
        "num_replicas_ready": sum(1 for r in replicas if r["state"] == "ready"),
        "requests_per_s": _r(sum(m["requests_per_s"] or 0.0 for m in models)),
        "errors_per_s": _r(sum(m["errors_per_s"] or 0.0 for m in models)),
        "generation_tokens_per_s": _r(sum(m.get("generation_tokens_per_s") or 0.0 for m in models)),
        "waiting": sum(m["waiting"] for m in models),
        "migrations_total": sum(sum(m["migrations"].values()) for m in models),
        "replica_events_total": sum(sum(m["replica_events"].values()) for m in models),
    }


def _by(now: Totals, name: str, model: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, _, value in now.select(name, {"model_name": model}):
        out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def _is_error(status: str) -> bool:
    """Errors are the 4xx and 5xx outcomes, except a client that left (499)."""
    return status.isdigit() and int(status) >= 400 and status != "499"


def _errors(samples: Iterable[tuple[dict[str, str], Any, float]]) -> float:
    return sum(v for labels, _, v in samples if _is_error(labels["status"]))


def _r(x: float | None) -> float | None:
    """JSON has no NaN or infinity; 6 significant digits are plenty for a chart."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.6g}")


def _state(service: ServiceView, dead: str | None) -> str:
    if dead is not None:
        return "dead"
    if getattr(service, "unhealthy_reason", None) is not None:
        return "unhealthy"  # a custom model's handler stuck in a call, or restarting
    return "ready" if service.is_ready else "loading"
