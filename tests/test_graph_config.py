"""kind: graph's mapping language and load-time checks (the executor: test_graph_executor.py)."""

from __future__ import annotations

import pytest

from fleetserve.serve.pipelines.graph_check import check_graph, terminal_kinds
from fleetserve.serve.pipelines.graph_config import GraphConfig
from fleetserve.serve.pipelines.graph_mapping import Scope, compile_template, parse_condition

KINDS = {"e": "embed", "c": "generate", "p": "custom"}


def graph(nodes: dict) -> GraphConfig:
    return GraphConfig.model_validate({"nodes": nodes})


def test_templates_select_and_interpolate() -> None:
    t = compile_template({"messages": [{"role": "user", "content": "Q: {$request.q} {$steps.e.data[0]}"}],
                          "raw": "$request.n", "lit": "$$5"})  # fmt: skip
    out = t(Scope({"q": "hi", "n": [1]}, None, {"e": {"data": [[0.5]]}}))
    assert out == {"messages": [{"role": "user", "content": "Q: hi [0.5]"}], "raw": [1],
                   "lit": "$5"}  # fmt: skip


def test_conditions() -> None:
    s = Scope({"lang": "fr", "n": 3}, None, {})
    assert parse_condition("$request.lang == fr").holds(s)
    assert not parse_condition("$request.n > 5").holds(s)
    assert parse_condition("$request.lang in [fr, de]").holds(s)
    assert not parse_condition("$request.missing").holds(s)


def test_a_type_mismatch_is_refused_with_the_key_path() -> None:
    g = graph({"root": {"type": "sequence", "steps": [{"model": "e"}, {"model": "c"}]}})
    with pytest.raises(ValueError, match=r"models\[0\]\.graph\.nodes\.root\.steps\[1\]"):
        check_graph(0, "g", g, KINDS)


def test_cycles_unknown_models_and_bad_refs_are_refused() -> None:
    cyc = graph({"root": {"type": "sequence", "steps": [{"node": "a"}]},
                 "a": {"type": "sequence", "steps": [{"node": "root", "name": "back"}]}})  # fmt: skip
    with pytest.raises(ValueError, match="a cycle: root -> a -> root"):
        check_graph(0, "g", cyc, KINDS)
    with pytest.raises(ValueError, match=r"steps\[0\]\.model .*no model 'x'"):
        check_graph(0, "g", graph({"root": {"type": "sequence", "steps": [{"model": "x"}]}}), KINDS)
    bad_ref = graph({"root": {"type": "sequence", "steps": [
        {"model": "c", "input": {"messages": "$steps.later.x"}}, {"model": "p", "name": "later"}]}})  # fmt: skip
    with pytest.raises(ValueError, match="has not run yet"):
        check_graph(0, "g", bad_ref, KINDS)


def test_a_good_graph_passes_and_knows_its_last_kind() -> None:
    g = graph({"root": {"type": "sequence", "steps": [
        {"model": "e", "input": {"input": "$request.q"}},
        {"model": "c", "input": {"messages": [{"role": "user", "content": "{$steps.e.data}"}]}}]}})  # fmt: skip
    check_graph(0, "g", g, KINDS)
    assert terminal_kinds(g, KINDS) == {"generate"}
