"""`kind: cascade` in the fleet file: refused at load with the key path when wrong; the
escalation rules on answers (no server)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetserve.serve.config.fleet_config import parse_fleet_config
from fleetserve.serve.pipelines.cascade_config import EscalateConfig
from fleetserve.serve.pipelines.rules import CascadeAnswer, Rules, load_predicate


def fleet(cascade: dict[str, Any]) -> dict[str, Any]:
    return {
        "models": [
            {"name": "small", "model": "/m/small"},
            {"name": "large", "model": "/m/large"},
            {"name": "clf", "kind": "custom", "handler": "fleet_handlers:Classifier"},
            {"name": "answer", "kind": "cascade", **cascade},
        ]
    }


GOOD = {"tiers": ["small", "large"], "escalate": {"min_mean_logprob": -1.0}}


def test_a_good_cascade_loads() -> None:
    entry = parse_fleet_config(fleet(GOOD)).models[3]
    assert entry.tiers == ["small", "large"]
    assert entry.escalate is not None and entry.escalate.min_mean_logprob == -1.0


@pytest.mark.parametrize(
    ("cascade", "message"),
    [
        (
            {**GOOD, "tiers": ["small", "nope"]},
            "models[3].tiers[1] (model 'answer'): no model 'nope'",
        ),
        (
            {**GOOD, "tiers": ["clf", "large"]},
            "models[3].tiers[0] (model 'answer'): 'clf' is a custom",
        ),
        ({**GOOD, "tiers": ["small"]}, "at least two tiers"),
        ({**GOOD, "tiers": ["small", "small"]}, "appears twice"),
        ({"tiers": ["small", "large"]}, "escalate: a cascade needs"),
        ({**GOOD, "escalate": {}}, "at least one rule"),
        ({**GOOD, "escalate": {"must_match": "("}}, "not a valid regex"),
        ({**GOOD, "escalate": {"must_match": {"type": 5}}}, "not a valid JSON schema"),
        ({**GOOD, "escalate": {"predicate": "no colon"}}, "package.module:function"),
        ({**GOOD, "escalate": {"bogus": 1}}, "models[3].escalate.bogus"),
        (
            {**GOOD, "decide_after_tokens": 4, "escalate": {"max_tokens_hit": True}},
            "escalate.max_tokens_hit needs the whole answer",
        ),
    ],
)
def test_bad_cascades_are_refused_with_the_key_path(cascade: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_fleet_config(fleet(cascade))
    assert message in str(info.value)


def test_cascade_keys_on_another_kind_are_refused() -> None:
    data = fleet(GOOD)
    data["models"][0]["tiers"] = ["large", "small"]
    with pytest.raises(ValueError, match=r"models\[0\].*for kind 'cascade'"):
        parse_fleet_config(data)


def answer(text: str = "x", lps: float | None = -0.5, finish: str | None = "stop") -> CascadeAnswer:
    return CascadeAnswer("small", text, (1, 2), lps, finish, finish is not None)


def test_rules_judge_answers() -> None:
    rules = Rules(EscalateConfig(min_mean_logprob=-1.0, max_tokens_hit=True, must_match=r"\d"))
    assert rules.judge(answer("7")) is None
    assert rules.judge(answer("7", lps=-2.0)) == "min_mean_logprob"
    assert rules.judge(answer("7", finish="length")) == "max_tokens_hit"
    assert rules.judge(answer("seven")) == "must_match"
    schema = Rules(EscalateConfig(must_match={"type": "object", "required": ["a"]}))
    assert schema.judge(answer('{"a": 1}')) is None
    assert schema.judge(answer('{"b": 1}')) == "must_match"
    assert schema.judge(answer("not json")) == "must_match"


def test_a_predicate_that_cannot_load_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="importing 'no_such_mod_xyz' failed"):
        load_predicate("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match="has no 'missing'"):
        load_predicate("cascade_rules:missing")


def test_ray_serves_a_cascade_from_the_ingress(tiny_llama: str) -> None:
    """A cascade has no deployment of its own on Ray: the ingress runs it over its tiers'
    clients (ray/fleet_client.py); tests/test_pipelines_ray.py serves one."""
    pytest.importorskip("ray")
    from fleetserve.ray.app import build_app

    cfg = fleet(GOOD)
    for m in cfg["models"][:2]:
        m["model"] = tiny_llama
    app = build_app(cfg)
    handles = app._bound_deployment.init_args[1]  # the ingress's model deployments
    assert sorted(handles) == ["clf", "large", "small"]
