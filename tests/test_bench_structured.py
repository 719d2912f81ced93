"""`fleetserve bench structured`: the served comparison's requests, answer checks, table
and argument errors (no server is started here; the figures are in docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from fleetserve.bench.serve_metrics import RequestResult
from fleetserve.bench.structured import ORDER_SCHEMA
from fleetserve.bench.structured_peers import check_answer, request_body, table
from fleetserve.entrypoints.cli import build_parser, main

ORDER = {
    "order_id": "ORD-123456",
    "customer": {"name": "Ann", "email": "ann@example.com", "tier": "pro"},
    "items": [{"sku": "HAM-001", "name": "hammer", "quantity": 2, "unit_price": 9.5}],
    "express": False,
    "notes": "",
}


def _result(text: str, reason: str) -> RequestResult:
    return RequestResult(10, 64, None, 0.1, 1.0, text=text, finish_reason=reason)


def test_free_and_constrained_bodies_differ_only_in_the_constraint() -> None:
    free = request_body("m", 3, "free", 64)
    schema = request_body("m", 3, "json_schema", 64)
    assert free["ignore_eos"] is True and "response_format" not in free
    assert "ignore_eos" not in schema
    fmt = schema["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == ORDER_SCHEMA
    for body in (free, schema):
        assert body["messages"] == free["messages"] and body["max_tokens"] == 64
        assert body["stream"] and body["stream_options"] == {"include_usage": True}


def test_answers_are_checked_against_the_schema() -> None:
    assert check_answer(_result(json.dumps(ORDER), "stop")) == "valid"
    bad = {**ORDER, "order_id": "123"}
    assert check_answer(_result(json.dumps(bad), "stop")) == "bad"
    assert check_answer(_result('{"order_id": "ORD-1', "length")) == "prefix"
    assert check_answer(_result("Sure! Here is", "length")) == "bad"  # schema ignored


def test_table_reports_the_ratio() -> None:
    row = {"tpot_ms": 10.0, "tok_s": 100.0, "tokens_per_request": 64.0, "cpu_ms_per_token": 8.0}
    free = {**row, "valid": 0, "prefix": 0, "bad": 0}
    con = {**row, "tok_s": 95.0, "valid": 1, "prefix": 2, "bad": 0}
    text = table({("fleetserve", 16): {"free": free, "json_schema": con}})
    assert "| fleetserve | 16 | 10.0 | 10.0 | 100.0 | 95.0 | -5.0% | 8.0 / 8.0 |" in text
    assert text.rstrip().endswith("| 1 / 2 / 0 |")


def test_peer_arguments_are_checked_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEETSERVE_VLLM_PYTHON", raising=False)
    assert main(["bench", "structured", "--compare", "vllm"]) == 2
    assert "--vllm-python" in capsys.readouterr().err
    args = build_parser(["bench", "structured"]).parse_args(
        ["bench", "structured", "--compare", "fleetserve", "llamacpp", "--streams", "1", "16"]
    )
    assert args.compare == ["fleetserve", "llamacpp"] and args.streams == [1, 16]
