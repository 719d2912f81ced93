"""`fleetserve deploy grafana`: the dashboard's shape (its PromQL runs against a real
Prometheus in tests/server/test_deploy_prometheus.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.deploy import grafana
from fleetserve.entrypoints.cli import main


def test_dashboard_panels_are_distinct_and_laid_out() -> None:
    board = grafana.dashboard()
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                assert (g["x"] + dx, g["y"] + dy) not in cells, p["title"]  # no overlap
                cells.add((g["x"] + dx, g["y"] + dy))
        ref_ids = [t["refId"] for t in p["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids)
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "namespace", "model", "class"}
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needed in ("num_requests_waiting", "num_requests_running", "time_to_first_token",
                   "time_per_output_token", "e2e_request_latency", "kv_cache_usage_perc",
                   "prefix_cache_hits", "replica_healthy", "batch_size", "requests_shed",
                   "http_requests_total", "status_class",
                   "histogram_quantile(0.5", "histogram_quantile(0.99"):  # fmt: skip
        assert needed in exprs, needed


def test_cli_writes_the_dashboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleetserve.json"
    assert main(["deploy", "grafana", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == grafana.dashboard()
    assert main(["deploy", "grafana", "--out", str(tmp_path / "no" / "x.json")]) == 2
    assert "--out" in capsys.readouterr().err
