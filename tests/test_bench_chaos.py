"""`fleetserve bench chaos` at a tiny size: its report's fields, and fleetserve losing
nothing and changing no stream under SIGKILL and SIGTERM (a correctness check against the
undisturbed run, not a timing one); Ray Serve's contrast in the slow stage."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from fleetserve.bench.chaos import add_cli_args, workload
from fleetserve.bench.chaos_report import migrated_ids, phase_summary
from fleetserve.bench.serve_metrics import RequestResult
from fleetserve.entrypoints.cli import main

NUM_REQUESTS = 12
FAULT_FIELDS = {
    "signal", "pid", "at_s", "num_requests", "gone_s", "out_of_routing_s", "removed_s",
    "replacement_started_s", "replacement_ready_s",
}  # fmt: skip


def _chaos(tmp_path: Path, model: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "chaos.json"
    argv = [
        "bench", "chaos", "--model", model, "--num-requests", str(NUM_REQUESTS),
        "--concurrency", "6", "--input-len", "8:16", "--output-len", "48:64",
        "--num-faults", "1", "--interval", "1.0", "--timeout", "120", "--json", str(out),
        *extra,
    ]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def _check_identical(run: dict[str, Any]) -> None:
    assert run["num_requests"] == NUM_REQUESTS
    assert run["num_lost"] == 0, run["errors"]
    assert run["num_compared"] == NUM_REQUESTS  # greedy and seeded: every one must repeat
    assert run["num_mismatched"] == 0


def test_fleetserve_loses_nothing_under_kills(tiny_llama: str, tmp_path: Path) -> None:
    report = _chaos(tmp_path, tiny_llama, "--sigterm-grace", "4")
    runs = {r["phase"]: r for r in report["runs"]}
    assert [r["system"] for r in report["runs"]] == ["fleetserve"] * 3
    assert set(runs) == {"reference", "sigkill", "sigterm"}
    for run in runs.values():
        _check_identical(run)
        for key in ("ttft_s", "e2e_s"):
            assert 0 < run[key]["p50"] <= run[key]["p99"], (key, run[key])
        assert run["ttft_s"]["p99"] <= run["e2e_s"]["max"]
    assert runs["reference"]["faults"] == [] and runs["reference"]["num_migrated_requests"] == 0

    killed = runs["sigkill"]
    (fault,) = killed["faults"]
    assert set(fault) == FAULT_FIELDS and fault["signal"] == "sigkill"
    assert fault["num_requests"] >= 1  # the replica signalled held requests
    for key in ("gone_s", "out_of_routing_s", "removed_s", "replacement_ready_s"):
        assert fault[key] is not None, (key, fault)
    # Its requests moved: the server's log and its metric agree on how many times.
    assert killed["num_migrations_logged"] == killed["num_migrations_metric"] >= 1
    assert 1 <= killed["num_migrated_requests"] <= killed["num_migrations_logged"]
    moved = killed["migrated"]
    assert moved["e2e_s"]["p50"] is not None and moved["added_e2e_s"]["p99"] is not None
    assert moved["max_gap_s"]["max"] > 0

    termed = runs["sigterm"]
    (fault,) = termed["faults"]
    assert fault["signal"] == "sigterm" and fault["gone_s"] is not None
    assert fault["removed_s"] is not None and fault["replacement_ready_s"] is not None
    assert termed["num_migrations_logged"] == termed["num_migrations_metric"]


@pytest.mark.slow
def test_ray_serve_contrast_fails_in_flight_requests(tiny_llama: str, tmp_path: Path) -> None:
    report = _chaos(tmp_path, tiny_llama, "--faults", "sigkill", "--compare", "ray")
    runs = {(r["system"], r["phase"]): r for r in report["runs"]}
    assert set(runs) == {(s, p) for s in ("fleetserve", "ray-serve") for p in ("reference", "sigkill")}  # fmt: skip
    _check_identical(runs["fleetserve", "sigkill"])
    assert runs["ray-serve", "reference"]["num_lost"] == 0
    killed = runs["ray-serve", "sigkill"]
    (fault,) = killed["faults"]
    assert fault["gone_s"] is not None and fault["num_requests"] is None
    # Ray Serve has no migration: the killed replica's streams break.
    assert killed["num_lost"] >= 1 and killed["errors"]
    # Its greedy streams (its sampling takes no seed) that did finish are whole.
    assert killed["num_compared"] <= NUM_REQUESTS // 2 and killed["num_mismatched"] == 0


# ------------------------------------------------------------- units
def _result(text: str, usage: tuple[int, int] = (5, 3), sid: str = "cmpl-a") -> RequestResult:
    return RequestResult(
        *usage, usage[1], ttft_s=0.1, e2e_s=1.0, itl_s=[0.2, 0.5], text=text,
        finish_reason="length", stream_id=sid,
    )  # fmt: skip


def test_phase_summary_counts_lost_changed_and_moved() -> None:
    reference = [_result("abc", sid="r0"), _result("def", sid="r1"), _result("ghi", sid="r2")]
    results = [
        _result("abc", sid="cmpl-0"),
        _result("deff", sid="cmpl-1"),  # a token repeated
        RequestResult(0, 0, 3, error="the stream ended before data: [DONE]"),
    ]
    s = phase_summary(results, reference, [True, True, True], ["cmpl-1", "cmpl-1"], [], {})
    assert s["num_lost"] == 1 and s["errors"] == ["the stream ended before data: [DONE]"]
    assert s["num_compared"] == 2 and s["num_mismatched"] == 1
    assert s["num_mismatched_migrated"] == 1
    assert s["num_migrations_logged"] == 2 and s["num_migrated_requests"] == 1
    assert s["migrated"]["added_e2e_s"]["p50"] == 0.0
    assert s["migrated"]["max_gap_s"]["max"] == 0.5
    assert s["not_migrated"]["added_e2e_s"]["p50"] == 0.0  # request 0 stayed
    # Usage counts too (billed twice), and an unreproducible request is not compared.
    s = phase_summary([_result("abc", (5, 4))], [_result("abc")], [True], [], [], {})
    assert s["num_mismatched"] == 1
    s = phase_summary([_result("xyz")], [_result("abc")], [False], [], [], {})
    assert s["num_compared"] == 0 and s["num_mismatched"] == 0


def test_migrated_ids_reads_the_services_log() -> None:
    log = (
        "2026-12-03 17:00:00 fleetserve.serve chaos: request cmpl-9f8e-0 moves off replica 1 "
        "(the engine process exited (code -9))\n"
        "2026-12-03 17:00:01 fleetserve.serve chaos: replica 1 died\n"
        "2026-12-03 17:00:02 fleetserve.serve chaos: request cmpl-12-3-0 moves off replica 2 "
        "(the replica was drained)\n"
    )
    assert migrated_ids(log) == ["cmpl-9f8e", "cmpl-12-3"]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(argv))


def test_workload_mixes_greedy_and_seeded() -> None:
    bodies = workload(_args("--num-requests", "6", "--output-len", "8:16"))
    assert [b["temperature"] for b in bodies] == [0.0, 1.0] * 3
    assert [b.get("seed") for b in bodies] == [None, 1, None, 3, None, 5]
    assert all(b["stream"] and b["ignore_eos"] and 8 <= b["max_tokens"] <= 16 for b in bodies)
    assert workload(_args("--num-requests", "6")) == workload(_args("--num-requests", "6"))


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--num-replicas", "1"], "--num-replicas"),
        (["--faults", "sigkill,sighup"], "--faults"),
        (["--interval", "0"], "--interval"),
        (["--concurrency", "0"], "--concurrency"),
        (["--model", "/no/such/model"], "--model"),
    ],
)
def test_bad_options_are_refused(argv: list[str], field: str, capsys: Any) -> None:
    assert main(["bench", "chaos", *argv]) == 2
    assert field in capsys.readouterr().err
