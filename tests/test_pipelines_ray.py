"""Composition on Ray (`fleetserve serve --ray`'s application on a real simulated cluster):
a graph and a cascade served by the ingress over the models' deployments, with the real
openai client (streaming and not; a greedy escalated answer is exactly the large tier's),
and a custom handler calling the fleet through the ingress's deployment handle (its
sub-calls in the parent's class, within its deadline: past it a 504 and the callee's
request ended; a missing model a clear 404). One cluster for the module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ray_cluster import ray_cluster, scrape, wait_healthy, wait_until

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ENGINE = {"max_num_seqs": 2, "num_threads": 1, "max_model_len": 512}
QUESTION: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]


def fleet_config(small: str, large: str) -> dict[str, Any]:
    tier = {"engine": ENGINE, "placement": {"num_cpus": 1}}
    return {
        "models": [
            {"name": "small", "model": small, **tier},
            {"name": "large", "model": large, **tier},
            {
                "name": "composer",
                "kind": "custom",
                "handler": "pipeline_handlers:Complete",
                "options": {"model": "small"},
                "timeout_s": 3.0,
                "batching": {"max_batch_size": 4, "batch_wait_timeout_s": 0.01},
                "placement": {"num_cpus": 0.25},
            },
            {
                "name": "streamer",
                "kind": "custom",
                "handler": "pipeline_handlers:StreamComplete",
                "options": {"model": "small"},
                "timeout_s": 30.0,
                "batching": {"max_batch_size": 1, "batch_wait_timeout_s": 0.0},
                "placement": {"num_cpus": 0.25},
            },
            {
                "name": "rag",
                "kind": "graph",
                "graph": {
                    "nodes": {
                        "root": {
                            "type": "sequence",
                            "steps": [
                                {
                                    "model": "composer",
                                    "name": "draft",
                                    "input": {
                                        "instances": [{"prompt": "$request.messages[-1].content"}]
                                    },
                                },
                                {
                                    "model": "large",
                                    "input": {
                                        "max_tokens": 6,
                                        "temperature": 0.0,
                                        "messages": [
                                            {
                                                "role": "system",
                                                "content": "Draft: {$steps.draft.predictions[0].text}",
                                            },
                                            "$request.messages[-1]",
                                        ],
                                    },
                                },
                            ],
                        }
                    }
                },
            },  # fmt: skip
            {
                "name": "up",
                "kind": "cascade",
                "tiers": ["small", "large"],
                "escalate": {"min_mean_logprob": 0.0},
            },
            {
                "name": "stay",
                "kind": "cascade",
                "tiers": ["small", "large"],
                "escalate": {"min_mean_logprob": -1e6},
            },
        ],  # fmt: skip
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}},
        "default_class": "interactive",
    }


@pytest.fixture(scope="module")
def base_url(tiny_model_factory: Any) -> Iterator[str]:
    from fleetserve.ray import IngressOptions, build_app

    small, large = tiny_model_factory("llama"), tiny_model_factory("llama", seed=7)
    # Paced steps: a 300-token sub-call outlasts its parent's 3 s deadline.
    env = {"FLEETSERVE_DEBUG_STEP_DELAY_S": "0.05"}
    with ray_cluster(num_workers=1, worker_cpus=3, env=env) as (_, url):
        serve.run(build_app(fleet_config(small, large), IngressOptions()), name="fleetserve",
                  route_prefix="/")  # fmt: skip
        wait_healthy(url)
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(scrape(url)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def greedy_chat(url: str, model: str, stream: bool = False) -> tuple[str, Any, Any]:
    c = client(url)
    if stream:
        chunks = list(
            c.chat.completions.create(
                model=model,
                messages=QUESTION,
                max_tokens=8,
                temperature=0.0,
                stream=True,  # type: ignore[arg-type]
            )
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return text, httpx.Headers(), (chunks[0].model_extra or {}).get("fleetserve")
    raw = c.chat.completions.with_raw_response.create(
        model=model,
        messages=QUESTION,
        max_tokens=8,
        temperature=0.0,  # type: ignore[arg-type]
    )
    out = raw.parse()
    return (
        out.choices[0].message.content or "",
        raw.headers,
        (out.model_extra or {}).get("fleetserve"),
    )


def predict(
    url: str,
    instances: list[dict[str, Any]],
    cls: str | None = None,
    headers: dict[str, str] | None = None,
    model: str = "composer",
) -> httpx.Response:
    headers = {**(headers or {}), **({"X-Fleetserve-Class": cls} if cls else {})}
    return httpx.post(f"{url}/v1/models/{model}:predict", json={"instances": instances},
                      headers=headers, timeout=60)  # fmt: skip


def test_a_cascade_on_ray_escalates_to_exactly_the_large_answer(base_url: str) -> None:
    large, _, _ = greedy_chat(base_url, "large")
    small, _, _ = greedy_chat(base_url, "small")
    before = metric(base_url, "fleetserve:cascade_escalations_total", model_name="up")
    text, headers, info = greedy_chat(base_url, "up")
    assert text == large and headers["X-Fleetserve-Tier"] == "large"
    assert info["tier"] == "large" and info["escalations"][0]["reason"] == "min_mean_logprob"
    after = metric(base_url, "fleetserve:cascade_escalations_total", model_name="up")
    assert after == before + 1
    text, headers, info = greedy_chat(base_url, "stay")
    assert text == small and headers["X-Fleetserve-Tier"] == "small" and info["tier"] == "small"
    # Streaming: the accepted tier's answer, from its start.
    assert greedy_chat(base_url, "up", stream=True)[0] == large
    assert greedy_chat(base_url, "stay", stream=True)[0] == small


def test_a_graph_on_ray_answers_what_its_steps_by_hand_answer(base_url: str) -> None:
    draft = predict(base_url, [{"prompt": QUESTION[0]["content"]}]).json()["predictions"][0]
    system = {"role": "system", "content": f"Draft: {draft['text']}"}
    by_hand = client(base_url).chat.completions.create(
        model="large",
        messages=[system, *QUESTION],
        max_tokens=6,
        temperature=0.0,  # type: ignore[list-item]
    )
    expected = by_hand.choices[0].message.content
    out = client(base_url).chat.completions.create(model="rag", messages=QUESTION)  # type: ignore[arg-type]
    assert out.choices[0].message.content == expected and out.model == "rag"
    info = (out.model_extra or {}).get("fleetserve")
    assert [(s["step"], s["model"]) for s in info["steps"]] == [
        ("draft", "composer"), ("large", "large")
    ]  # fmt: skip
    chunks = list(
        client(base_url).chat.completions.create(model="rag", messages=QUESTION, stream=True)  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    r = httpx.post(f"{base_url}/v1/models/rag:predict", json={"instances": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_a_handler_calls_the_fleet_through_the_ingress(base_url: str) -> None:
    direct = client(base_url).completions.create(
        model="small", prompt="The sea", max_tokens=4, temperature=0.0
    )
    key = "fleetserve:generation_tokens_total"
    before = metric(base_url, key, model_name="small")
    r = predict(base_url, [{"prompt": "The sea"}, {"prompt": "The sea"}])
    assert r.status_code == 200, r.text
    assert r.json()["predictions"] == [{"text": direct.choices[0].text, "model": "small"}] * 2
    # The sub-calls are the callee's requests, counted under its model_name.
    assert metric(base_url, key, model_name="small") - before == 8


def test_a_handler_streams_a_sub_call_through_the_ingress(base_url: str) -> None:
    direct = client(base_url).completions.create(
        model="small", prompt="The sea", max_tokens=5, temperature=0.0
    )
    r = predict(base_url, [{"prompt": "The sea", "max_tokens": 5}], model="streamer")
    assert r.status_code == 200, r.text
    (pred,) = r.json()["predictions"]
    # Chunk by chunk through the handle's stream: the text is the direct answer's.
    assert pred["text"] == direct.choices[0].text and pred["chunks"] >= 2, pred
    r = predict(base_url, [{"prompt": "x", "model": "nope"}], model="streamer")
    (pred,) = r.json()["predictions"]
    assert pred["status"] == 404 and "'nope' does not exist" in pred["error"], pred


def _idle(handle: Any) -> bool:
    """No request in `small`'s engine, asked of its replica through a driver-side handle.
    Bounded, so that a handle that cannot hear from the replica fails the test instead of
    hanging it: that was once a cluster whose workers' calls into this process were refused
    (Ray's authentication mode differed between them; conftest.py pins it)."""
    return bool(handle.info.remote().result(timeout_s=10)["num_requests"] == 0)


def test_a_handler_that_stops_reading_ends_its_streamed_sub_call(base_url: str) -> None:
    from fleetserve.ray.pool_deployments import deployment_name

    small = serve.get_deployment_handle(deployment_name("small"), "fleetserve")
    # 300 tokens at 0.05 s a step would run ~15 s; the handler stops after 2 chunks.
    r = predict(base_url, [{"prompt": "The sea", "max_tokens": 300, "read": 2}], model="streamer")
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0]["chunks"] == 2
    wait_until(lambda: _idle(small), 6, "the abort")


def test_a_client_that_leaves_ends_the_handlers_sub_calls(base_url: str) -> None:
    from fleetserve.ray.pool_deployments import deployment_name

    small = serve.get_deployment_handle(deployment_name("small"), "fleetserve")
    # ~15 s of sub-call (300 tokens at 0.05 s a step); the client leaves at 1 s, inside the
    # handler's timeout_s (30 s): only its leaving can end the sub-call.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/models/streamer:predict", timeout=1.0,
                   json={"instances": [{"prompt": "The sea", "max_tokens": 300}]})  # fmt: skip
    wait_until(lambda: _idle(small), 6, "the abort")
    assert predict(base_url, [{"prompt": "The sea"}], model="streamer").status_code == 200


def test_a_sub_call_to_a_missing_model_is_a_clear_error(base_url: str) -> None:
    r = predict(base_url, [{"prompt": "x", "model": "nope"}])
    assert r.status_code == 200, r.text
    (pred,) = r.json()["predictions"]
    assert pred["status"] == 404 and "'nope' does not exist" in pred["error"], pred


def test_sub_calls_take_the_parents_class(base_url: str) -> None:
    ttft = "fleetserve:time_to_first_token_seconds_count"

    def counts() -> tuple[float, float]:
        return (
            metric(base_url, ttft, model_name="small", **{"class": "batch"}),
            metric(base_url, ttft, model_name="small", **{"class": "interactive"}),
        )

    before = counts()
    assert predict(base_url, [{"prompt": "a"}, {"prompt": "b"}], "batch").status_code == 200
    wait_until(lambda: counts() == (before[0] + 2, before[1]), 10, "2 batch-class sub-calls")


def test_a_sub_call_past_its_parents_deadline_is_504_and_cancelled(base_url: str) -> None:
    from fleetserve.ray.pool_deployments import deployment_name

    small = serve.get_deployment_handle(deployment_name("small"), "fleetserve")
    # 300 tokens at 0.05 s a step outlast the handler's timeout_s of 3 s.
    r = predict(base_url, [{"prompt": "The sea", "max_tokens": 300}])
    if r.status_code == 200:  # the sub-call's own deadline noticed first
        (pred,) = r.json()["predictions"]
        assert pred["status"] == 504 and "deadline" in pred["error"], r.text
    else:  # the parent's timeout did
        assert r.status_code == 504, r.text
    # Left running, it would take ~15 s; cancelled, the small replica is idle at once.
    wait_until(lambda: _idle(small), 6, "the abort")
    assert predict(base_url, [{"prompt": "The sea"}]).status_code == 200


def test_the_parents_access_line_lists_its_sub_calls(base_url: str) -> None:
    import glob
    import json

    r = predict(base_url, [{"prompt": "a"}, {"prompt": "x", "model": "nope"}],
                headers={"X-Request-Id": "ray-parent-with-subcalls"})  # fmt: skip
    assert r.status_code == 200, r.text
    # The ingress's access log is its actor's stdout: Ray's worker log files.
    session = ray._private.worker._global_node.get_session_dir_path()
    found: list[dict[str, Any]] = []

    def logged() -> bool:
        for path in glob.glob(f"{session}/logs/worker-*.out"):
            with open(path, errors="replace") as f:
                for text in f:
                    if text.startswith("{") and "ray-parent-with-subcalls" in text:
                        found[:] = [json.loads(text)]
        return bool(found)

    wait_until(logged, 15, "the parent's access-log line")
    got = sorted((s["model"], s["method"], s["status"]) for s in found[0]["sub_calls"])
    assert got == [("nope", "complete", 404), ("small", "complete", 200)]
