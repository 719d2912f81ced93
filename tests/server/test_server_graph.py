"""Graphs (`kind: graph`) on a real server with tiny models and the real openai client:
embed -> generate (chat, streamed and not) gives what the two calls by hand give; a switch,
an ensemble and a seeded splitter over the predict route; the `fleetserve` field lists the
steps that ran; a graph's timeout cancels its steps; bad graphs are refused at start with
their key path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_proc import ServerProc, metric, scrape, wait_until

QUESTION = [{"role": "user", "content": "Where is the moon?"}]


@pytest.fixture(scope="module")
def fleet(pipeline_fleet: ServerProc) -> ServerProc:
    """The session's pipeline fleet (tests/server/pipeline_fleet.py)."""
    return pipeline_fleet


def client(srv: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def by_hand(srv: ServerProc) -> str:
    """What the rag graph's two steps give when a client makes the calls itself."""
    c = client(srv)
    vec = c.embeddings.create(model="minilm", input=QUESTION[0]["content"]).data[0].embedding
    system = {"role": "system", "content": f"Context: {vec[0]}"}
    out = c.chat.completions.create(
        model="tiny",
        messages=[system, *QUESTION],
        max_tokens=6,
        temperature=0.0,  # type: ignore[list-item]
    )
    return out.choices[0].message.content or ""


def predict(srv: ServerProc, name: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/models/{name}:predict", json=body, timeout=60)


def test_a_chat_graph_answers_what_its_steps_by_hand_answer(fleet: ServerProc) -> None:
    expected = by_hand(fleet)
    before = scrape(fleet.url)
    out = client(fleet).chat.completions.create(model="rag", messages=QUESTION)  # type: ignore[arg-type]
    assert out.choices[0].message.content == expected
    assert out.model == "rag"
    info = (out.model_extra or {})["fleetserve"]
    assert info["graph"] == "rag"
    assert [(s["step"], s["model"]) for s in info["steps"]] == [("vec", "minilm"), ("tiny", "tiny")]
    after = scrape(fleet.url)
    key = "fleetserve:graph_steps_total"
    for step in ("vec", "tiny"):  # the answering step too, run by the HTTP layer
        labels = {"model_name": "rag", "node": "root", "step": step, "outcome": "ok"}
        assert metric(after, key, **labels) - metric(before, key, **labels) == 1
    assert all(s["ms"] > 0 for s in info["steps"])
    # The answer is the callee's request, counted under its own model_name.
    tokens = "fleetserve:generation_tokens_total"
    assert metric(after, tokens, model_name="tiny") - metric(before, tokens, model_name="tiny") == 6


def test_a_chat_graph_streams_its_last_step(fleet: ServerProc) -> None:
    expected = by_hand(fleet)
    stream = client(fleet).chat.completions.create(
        model="rag",
        messages=QUESTION,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].model == "rag"
    info = (chunks[0].model_extra or {})["fleetserve"]
    assert [s["step"] for s in info["steps"]] == ["vec", "tiny"]
    assert chunks[-1].choices[0].finish_reason == "length"
    # The last chunk reports the steps again, with the streamed last step's time.
    last = (chunks[-1].model_extra or {})["fleetserve"]
    assert [s["step"] for s in last["steps"]] == ["vec", "tiny"]
    assert all(s["ms"] > 0 for s in last["steps"])


def test_a_completion_graph_answers_and_streams_its_last_step(fleet: ServerProc) -> None:
    c = client(fleet)
    direct = c.completions.create(model="tiny", prompt="Label: odd", max_tokens=5, temperature=0.0)
    body = {"instances": [{"text": "abc"}]}  # odd: 3 letters
    out = c.completions.create(model="tell", prompt="", extra_body=body)
    assert out.choices[0].text == direct.choices[0].text and out.model == "tell"
    steps = (out.model_extra or {})["fleetserve"]["steps"]
    assert [s["step"] for s in steps] == ["classifier", "tiny"]
    chunks = list(c.completions.create(model="tell", prompt="", stream=True, extra_body=body))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == direct.choices[0].text
    assert chunks[0].object == "text_completion"
    assert (chunks[-1].model_extra or {})["fleetserve"]["steps"][-1]["ms"] > 0
    with pytest.raises(openai.BadRequestError, match="takes a prompt; call /v1/completions"):
        c.chat.completions.create(model="tell", messages=QUESTION, extra_body=body)  # type: ignore[arg-type]


def test_a_switch_routes_on_the_request(fleet: ServerProc) -> None:
    for text, step, pred in (("apple", "short", {"label": "odd", "length": 5}),
                             ("pear", "long", {"label": "even", "length": 6})):  # fmt: skip
        r = predict(fleet, "route", {"instances": [{"text": text}]})
        assert r.status_code == 200, r.text
        assert r.json()["predictions"] == [pred]
        assert [s["step"] for s in r.json()["fleetserve"]["steps"]] == [step]


def test_an_ensemble_merges_its_steps_by_name(fleet: ServerProc) -> None:
    r = predict(fleet, "both", {"instances": [{"text": "abc"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["classifier"] == {"predictions": [{"label": "odd", "length": 3}]}
    assert len(body["minilm"]["data"][0]["embedding"]) == 384
    assert {s["step"] for s in body["fleetserve"]["steps"]} == {"classifier", "minilm"}


def test_a_splitter_sends_to_both_branches(fleet: ServerProc) -> None:
    seen = set()
    for _ in range(12):
        r = predict(fleet, "ab", {"instances": [{"text": "ab"}]})
        assert r.status_code == 200, r.text
        seen.add(r.json()["fleetserve"]["steps"][0]["step"])
    assert seen == {"a", "b"}


def test_bad_requests_to_a_graph_are_4xx_with_the_openai_body(fleet: ServerProc) -> None:
    r = predict(fleet, "rag", {"instances": []})
    assert r.status_code == 400 and "step 'vec'" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError, match="does not end in a generate model"):
        client(fleet).chat.completions.create(model="both", messages=QUESTION)  # type: ignore[arg-type]


def test_a_graph_past_its_timeout_cancels_its_steps(fleet: ServerProc) -> None:
    aborted = "fleetserve:request_success_total"
    before = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
    r = predict(fleet, "slow", {})
    assert r.status_code == 504 and "timeout_s" in r.text, r.text

    def step_aborted() -> bool:
        now = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
        return now == before + 1

    # Left running, its 400 tokens at >= 0.02 s a step would end 'length' after 8+ s.
    assert wait_until(step_aborted, 5.0)


def test_a_graph_past_the_request_s_deadline_is_a_504_and_cancels_its_steps(
    fleet: ServerProc,
) -> None:
    aborted = "fleetserve:request_success_total"
    before = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
    r = httpx.post(f"{fleet.url}/v1/models/slow:predict", json={}, timeout=60,
                   headers={"X-Fleetserve-Deadline-Ms": "300"})  # fmt: skip
    # Well inside the graph's own timeout_s (1 s): the request's deadline ends it.
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded", r.text

    def step_aborted() -> bool:
        now = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
        return now == before + 1

    assert wait_until(step_aborted, 5.0)


BAD = {
    "cycle": ("{root: a, nodes: {a: {type: sequence, steps: [{node: b}]}, "
              "b: {type: sequence, steps: [{node: a, name: back}]}}}",
              r"models[1].graph.nodes.b.steps[0].node"),
    "unknown": ("{nodes: {root: {type: sequence, steps: [{model: nope}]}}}",
                r"models[1].graph.nodes.root.steps[0].model"),
    "mismatch": ("{nodes: {root: {type: sequence, steps: [{model: minilm, input: {input: x}}, "
                 "{model: tiny}]}}}", r"models[1].graph.nodes.root.steps[1]"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_graph_is_refused_at_start_with_its_key_path(
    case: str, tiny_llama: str, tmp_path: Path
) -> None:
    graph, key = BAD[case]
    path = tmp_path / "fleet.yaml"
    path.write_text(f"models:\n  - {{name: tiny, model: {tiny_llama}}}\n"
                    f"  - {{name: g, kind: graph, graph: {graph}}}\n"
                    "  - {name: minilm, kind: embed}\n")  # fmt: skip
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "serve", "--config", str(path),
           "--host", "127.0.0.1", "--port", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode != 0
    assert key in done.stderr + done.stdout, done.stderr[-2000:]


def test_a_graph_is_listed_and_the_status_pages_serve_it(fleet: ServerProc) -> None:
    kinds = {m.id: (m.model_extra or {}).get("kind") for m in client(fleet).models.list()}
    assert kinds["rag"] == "graph" and kinds["tiny"] == "generate"
    for path in ("/health", "/ready", "/dashboard/api/snapshot", "/metrics"):
        r = httpx.get(fleet.url + path, timeout=30)
        assert r.status_code == 200, (path, r.text[:500])
    assert (
        'fleetserve:graph_requests_total{model_name="ab",outcome="ok"}'
        in httpx.get(fleet.url + "/metrics", timeout=30).text
    )


def test_a_graph_step_runs_in_the_request_s_class(fleet: ServerProc) -> None:
    key = "fleetserve:e2e_request_latency_seconds_count"
    before = scrape(fleet.url)
    body = {"instances": [{"text": "abc"}]}
    for path in ("/v1/models/tell:predict", "/v1/completions"):  # a step, then the answer
        extra = {} if "predict" in path else {"model": "tell", "prompt": ""}
        r = httpx.post(fleet.url + path, json={**body, **extra}, timeout=60,
                       headers={"X-Fleetserve-Class": "batch"})  # fmt: skip
        assert r.status_code == 200, r.text
    after = scrape(fleet.url)
    for cls, n in (("batch", 2), ("interactive", 0)):
        got = metric(after, key, model_name="tiny", **{"class": cls})
        assert got - metric(before, key, model_name="tiny", **{"class": cls}) == n, cls
