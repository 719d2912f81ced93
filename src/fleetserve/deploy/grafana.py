"""`fleetserve deploy grafana`: the fleet's Grafana dashboard, as Grafana's JSON model.

Every panel reads the server's own series (`fleetserve:*`, labels `model_name`, `class`)
plus what the scrape adds on Kubernetes (`namespace`, `fleetserve_pool`; see
deploy/monitoring.py). The variables `$namespace`, `$model` and `$class` are regex
matchers whose "All" is `.*`, so the same dashboard reads a Prometheus without Kubernetes
labels (`.*` matches a missing label).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.deploy.monitoring import POOL_LABEL, prometheus_label

_DS = {"type": "prometheus", "uid": "${datasource}"}
_POOL = prometheus_label(POOL_LABEL)
_NS = 'namespace=~"$namespace"'
_M = f'{_NS},model_name=~"$model"'
_MC = f'{_M},class=~"$class"'


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


def _rate(metric: str, matchers: str) -> str:
    return f"rate({metric}{{{matchers}}}[$__rate_interval])"


def _quantiles(histogram: str, by: str, matchers: str) -> tuple[tuple[str, str], ...]:
    legend = " ".join("{{" + label.strip() + "}}" for label in by.split(","))
    return tuple(
        (
            f"histogram_quantile({q}, sum by (le, {by}) ({_rate(histogram + '_bucket', matchers)}))",
            f"{legend} p{int(q * 100)}",
        )
        for q in (0.5, 0.99)
    )


PANELS: tuple[Panel, ...] = (
    Panel("Requests waiting (queue depth)", "short", (
        (f"sum by (model_name, class) (fleetserve:num_requests_waiting{{{_MC}}})",
         "{{model_name}} {{class}}"),
    ), "The autoscaling signal: requests not started yet, per model and class."),
    Panel("Requests running (generate batch size)", "short", (
        (f"sum by (model_name) (fleetserve:num_requests_running{{{_M}}})", "{{model_name}}"),
    )),
    Panel("Finished requests / s by reason", "reqps", (
        (f"sum by (model_name, finished_reason) "
         f"({_rate('fleetserve:request_success_total', _M)})",
         "{{model_name}} {{finished_reason}}"),
    )),
    Panel("HTTP requests / s by route and status class", "reqps", (
        (f"sum by (model_name, route, status_class) (label_replace("
         f"{_rate('fleetserve:http_requests_total', _MC)}, "
         '"status_class", "${1}xx", "status", "([0-9]).*"))',
         "{{model_name}} {{route}} {{status_class}}"),
    ), "Every answer to a model's request, by the status its outcome stands for (a stream "
       "that failed after its 200 counts as its error; 499: the client left)."),
    Panel("Requests shed / s (errors) by class and reason", "reqps", (
        (f"sum by (model_name, class, reason) ({_rate('fleetserve:requests_shed_total', _MC)})",
         "{{model_name}} {{class}} {{reason}}"),
    ), "Refused before any compute: class queue full (503) or queue time over."),
    Panel("Time to first token", "s",
          _quantiles("fleetserve:time_to_first_token_seconds", "model_name, class", _MC)),
    Panel("Time per output token", "s",
          _quantiles("fleetserve:time_per_output_token_seconds", "model_name, class", _MC)),
    Panel("End-to-end latency", "s",
          _quantiles("fleetserve:e2e_request_latency_seconds", "model_name, class", _MC)),
    Panel("Tokens / s", "short", (
        (f"sum by (model_name) ({_rate('fleetserve:prompt_tokens_total', _M)})",
         "{{model_name}} prompt"),
        (f"sum by (model_name) ({_rate('fleetserve:generation_tokens_total', _M)})",
         "{{model_name}} generated"),
    )),
    Panel("KV cache usage", "percentunit", (
        (f"max by (model_name, instance) (fleetserve:kv_cache_usage_perc{{{_M}}})",
         "{{model_name}} {{instance}}"),
    )),
    Panel("Prefix cache hit rate", "percentunit", (
        (f"sum by (model_name) ({_rate('fleetserve:replica_prefix_cache_hits_total', _M)}) / "
         f"sum by (model_name) ({_rate('fleetserve:replica_prefix_cache_queries_total', _M)})",
         "{{model_name}}"),
    ), "Prompt tokens found cached over prompt tokens looked up."),
    Panel("Replicas healthy and pods up, per pool (spot / on_demand)", "short", (
        (f"sum by (model_name, {_POOL}) (fleetserve:replica_healthy{{{_M}}})",
         f"{{{{model_name}}}} {{{{{_POOL}}}}} engines healthy"),
        (f'sum by (fleetserve_model, {_POOL}) (up{{{_NS},{_POOL}!=""}})',
         f"{{{{fleetserve_model}}}} {{{{{_POOL}}}}} pods up"),
    )),
    Panel("Dynamic batch size (embed / custom models)", "short",
          _quantiles("fleetserve:batch_size", "model_name", _M)),
    Panel("Engine replicas by pool and state", "short", (
        (f"sum by (model_name, pool, capacity, state) (fleetserve:replicas{{{_M}}})",
         "{{model_name}} {{pool}} ({{capacity}}) {{state}}"),
    ), "Spot and on-demand pools of each generate model (fallback replicas show here)."),
    Panel("Requests moved to another replica / s", "reqps", (
        (f"sum by (model_name, reason) ({_rate('fleetserve:request_migrations_total', _M)})",
         "{{model_name}} {{reason}}"),
    ), "Request migration: its replica died, was drained (spot notice, SIGTERM), hung."),
    Panel("Replica events / s", "short", (
        (f"sum by (model_name, event) ({_rate('fleetserve:replica_events_total', _M)})",
         "{{model_name}} {{event}}"),
    ), "started, failed (died), hung, notice (preemption), drained, no_capacity."),
    Panel("Engine preemptions / s (KV cache or seats short)", "short", (
        (f"sum by (model_name) ({_rate('fleetserve:num_preemptions_total', _M)})",
         "{{model_name}}"),
    )),
)  # fmt: skip


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": _DS,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,  # on time range change: new models appear without a reload
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
    }


def _panel(index: int, panel: Panel) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": _DS,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": _DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    metric = "fleetserve:num_requests_waiting"
    return {
        "uid": "fleetserve",
        "title": "fleetserve",
        "tags": ["fleetserve"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                },
                _variable("namespace", "Namespace", f"label_values({metric}, namespace)"),
                _variable("model", "Model", f"label_values({metric}{{{_NS}}}, model_name)"),
                _variable("class", "Class", f"label_values({metric}{{{_M}}}, class)"),
            ]
        },  # fmt: skip
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the dashboard JSON file to write")


def run(args: argparse.Namespace) -> int:
    path = Path(args.out)
    if path.parent and not path.parent.is_dir():
        raise ValueError(f"--out {args.out}: folder {str(path.parent)!r} does not exist")
    path.write_text(json.dumps(dashboard(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: import it in Grafana (Dashboards > New > Import)")
    return 0
