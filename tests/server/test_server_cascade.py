"""Cascades (`kind: cascade`) on a real server with the real openai client: a request runs
on the small tier and goes up to the large one when the rule fires; a greedy request that
escalates gets exactly what the large tier alone returns; the tier is told in the
X-Fleetserve-Tier header and the `fleetserve` field; metrics count tiers and escalations."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from server_proc import ServerProc, metric, scrape

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def fleet(pipeline_fleet: ServerProc) -> ServerProc:
    """The session's pipeline fleet (tests/server/pipeline_fleet.py)."""
    return pipeline_fleet


def client(srv: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def chat(srv: ServerProc, model: str, **kw: Any) -> tuple[str, str, dict[str, Any] | None]:
    """(text, X-Fleetserve-Tier header, fleetserve field) of a greedy chat request."""
    raw = client(srv).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0.0, **kw
    )
    body = raw.parse()
    extra = body.model_extra or {}
    return (
        body.choices[0].message.content or "",
        raw.headers.get("x-fleetserve-tier"),
        extra.get("fleetserve"),
    )


def stream_chat(srv: ServerProc, model: str) -> tuple[str, str | None, dict[str, Any] | None]:
    with client(srv).chat.completions.with_streaming_response.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0.0, stream=True
    ) as raw:
        tier = raw.headers.get("x-fleetserve-tier")
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, tier, (chunks[0].model_extra or {}).get("fleetserve")


def test_an_escalated_greedy_request_is_the_large_tiers_answer(fleet: ServerProc) -> None:
    large, _, _ = chat(fleet, "large")
    small, _, _ = chat(fleet, "small")
    assert large != small  # the tiers differ, so the test tells them apart
    text, tier, info = chat(fleet, "up")
    assert (text, tier) == (large, "large")
    assert info == {
        "tier": "large",
        "escalations": [{"tier": "small", "reason": "min_mean_logprob"}],
    }
    text, tier, info = chat(fleet, "stay")
    assert (text, tier, info) == (small, "small", {"tier": "small", "escalations": []})


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("by_length", "max_tokens_hit"),
        ("by_regex", "must_match"),
        ("by_schema", "must_match"),
        ("by_predicate", "predicate"),
    ],
)
def test_each_rule_escalates(fleet: ServerProc, model: str, reason: str) -> None:
    large, _, _ = chat(fleet, "large")
    text, tier, info = chat(fleet, model)
    assert (text, tier) == (large, "large")
    assert info is not None and info["escalations"] == [{"tier": "small", "reason": reason}]


def test_a_rule_that_holds_keeps_the_small_answer(fleet: ServerProc) -> None:
    small, _, _ = chat(fleet, "small")
    # Two tokens are not "longer than three": the predicate accepts.
    raw = client(fleet).chat.completions.with_raw_response.create(
        model="by_predicate", messages=MESSAGES, max_tokens=2, temperature=0.0
    )
    assert raw.headers["x-fleetserve-tier"] == "small"
    direct = client(fleet).chat.completions.create(
        model="small", messages=MESSAGES, max_tokens=2, temperature=0.0
    )
    assert raw.parse().choices[0].message.content == direct.choices[0].message.content
    assert small.startswith(direct.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("model", "tier"),
    [("up", "large"), ("stay", "small"), ("early_up", "large"), ("early_stay", "small")],
)
def test_streams_are_the_accepted_tiers_answer(fleet: ServerProc, model: str, tier: str) -> None:
    expected, _, _ = chat(fleet, tier)
    text, header, info = stream_chat(fleet, model)
    assert (text, header) == (expected, tier)
    assert info is not None and info["tier"] == tier
    assert len(info["escalations"]) == (1 if tier == "large" else 0)


def test_completions_endpoint(fleet: ServerProc) -> None:
    c = client(fleet)
    direct = c.completions.create(model="large", prompt="The sea", max_tokens=6, temperature=0.0)
    raw = c.completions.with_raw_response.create(
        model="up", prompt="The sea", max_tokens=6, temperature=0.0
    )
    assert raw.headers["x-fleetserve-tier"] == "large"
    assert raw.parse().choices[0].text == direct.choices[0].text
    assert raw.parse().model == "up"
    streamed = c.completions.create(
        model="up", prompt="The sea", max_tokens=6, temperature=0.0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == direct.choices[0].text


def test_metrics_count_tiers_tokens_and_escalations(fleet: ServerProc) -> None:
    before = scrape(fleet.url)
    chat(fleet, "up")
    chat(fleet, "stay")
    after = scrape(fleet.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    req = "fleetserve:cascade_requests_total"
    assert delta(req, model_name="up", tier="large") == 1
    assert delta(req, model_name="up", tier="small") == 0
    assert delta(req, model_name="stay", tier="small") == 1
    esc = "fleetserve:cascade_escalations_total"
    assert delta(esc, model_name="up", tier="small", reason="min_mean_logprob") == 1
    tok = "fleetserve:cascade_tokens_total"
    assert delta(tok, model_name="up", tier="small") == 8  # the escalated answer's tokens
    assert delta(tok, model_name="up", tier="large") == 8
    # The tiers' own series count the sub-calls under their own model_name.
    assert delta("fleetserve:generation_tokens_total", model_name="large") >= 8


def test_models_listing_and_errors(fleet: ServerProc) -> None:
    cards = {m["id"]: m for m in httpx.get(f"{fleet.url}/v1/models").json()["data"]}
    assert cards["up"]["kind"] == "cascade" and cards["up"]["tiers"] == ["small", "large"]
    with pytest.raises(openai.BadRequestError) as info:
        client(fleet).chat.completions.create(model="up", messages=MESSAGES, max_tokens=10_000)
    assert "max_tokens" in json.dumps(info.value.body)


def deadline(ms: float) -> dict[str, dict[str, str]]:
    return {"extra_headers": {"X-Fleetserve-Deadline-Ms": str(ms)}}


def test_a_slow_first_tier_leaves_the_next_only_the_remainder(fleet: ServerProc) -> None:
    from cascade_rules import SLOW_S

    large, _, _ = chat(fleet, "large")
    text, tier, info = chat(fleet, "slow_up", **deadline(10_000))
    assert (text, tier) == (large, "large")
    assert info is not None and info["escalations"] == [{"tier": "small", "reason": "predicate"}]
    first, second = info["budget_ms"]  # the ms of the deadline each tier was given
    assert 0 < second <= first - SLOW_S * 1e3 and first <= 10_000


def test_a_deadline_that_ends_in_the_first_tier_is_a_504_not_an_escalation(
    fleet: ServerProc,
) -> None:
    before = scrape(fleet.url)
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client(fleet).chat.completions.create(
                model="slow_up", messages=MESSAGES, max_tokens=4, stream=stream, **deadline(400)
            )
        assert info.value.status_code == 504
        assert info.value.body["code"] == "deadline_exceeded"  # type: ignore[index]
        assert "tier 'small'" in info.value.body["message"]  # type: ignore[index]
    after = scrape(fleet.url)
    requests = "fleetserve:cascade_requests_total"
    assert metric(after, requests, model_name="slow_up") == metric(
        before, requests, model_name="slow_up"
    )
    # The large tier never ran: no escalation was counted, no request reached it.
    esc = "fleetserve:cascade_escalations_total"
    assert metric(after, esc, model_name="slow_up") == metric(before, esc, model_name="slow_up")
