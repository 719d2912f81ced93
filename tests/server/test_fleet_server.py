"""A fleet server (`fleetserve serve --config`): models by name, classes, shedding, and the
SLA that matters: interactive requests overtake a batch flood, and the flood completes.

Engine steps are paced with FLEETSERVE_DEBUG_STEP_DELAY_S, so the assertions are about
order and counts (which request got its first token before which), never about speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_proc import ServerProc, metric, scrape, wait_until

from fleetserve.bench.fleet_entries import custom_entry, embed_entry, fleet_file, generate_entry

CLASSES = """\
classes:
  interactive: {priority: 0, max_waiting: 16}
  batch: {priority: 10, max_waiting: 64}
  tail: {priority: 20, max_waiting: 1, max_queue_time_s: 1.0}
default_class: interactive
"""


def fleet_config(model: str) -> str:
    classifier = custom_entry(
        "classifier",
        "fleet_handlers:Classifier",
        options="{labels: [even, odd]}",
        max_batch_size=4,
        batch_wait_timeout_s=0.02,
    )
    tiny = generate_entry("tiny", model, max_num_seqs=2, num_threads=1, max_model_len=512)
    return fleet_file([tiny, embed_entry(max_batch_size=8), classifier], CLASSES)


STEP_DELAY_S = "0.03"
FLOOD, FLOOD_TOKENS = 8, 30


@pytest.fixture(scope="module")
def fleet(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    path = tmp_path_factory.mktemp("fleet") / "fleet.yaml"
    path.write_text(fleet_config(tiny_llama))
    # The custom handler lives in tests/fleet_handlers.py.
    tests_dir = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    env = {"FLEETSERVE_DEBUG_STEP_DELAY_S": STEP_DELAY_S, "PYTHONPATH": pythonpath}
    srv = ServerProc(None, "--config", str(path), env=env)
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.final_output


def client(srv: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def test_every_dashboard_series_exists_from_the_start(fleet: ServerProc) -> None:
    """First in this module: the server has had no request yet. Every series a Grafana
    panel queries is on /metrics, for every model it applies to, at 0 where it counts."""
    from fleetserve.deploy import grafana

    exprs = [t["expr"] for p in grafana.dashboard()["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"fleetserve:[A-Za-z0-9_:]+", e)}
    assert len(names) >= 15, names
    values = scrape(fleet.url)
    models = {n: set() for n in names}  # type: dict[str, set[str]]
    for key in values:
        name, _, labels = key.partition("{")
        if name in models:
            models[name].add(re.search(r'model_name="([^"]*)"', labels)[1])  # type: ignore[index]
    batch_series = {"fleetserve:batch_size_bucket"}
    for name in names:
        expected = {"minilm", "classifier"} if name in batch_series else {"tiny"}
        assert expected <= models[name], (name, models[name])
    for cls in ("interactive", "batch", "tail"):
        for reason in ("queue_full", "queue_timeout", "no_replica"):
            labels = {"model_name": "tiny", "class": cls, "reason": reason}
            key = (
                "fleetserve:requests_shed_total{"
                + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                + "}"
            )
            assert values[key] == 0
    assert metric(values, "fleetserve:batch_size_count") == 0
    assert metric(values, "fleetserve:http_requests_total") == 0


def test_each_endpoint_serves_its_kind_of_model(fleet: ServerProc) -> None:
    c = client(fleet)
    listed = {m.id: m.model_extra["kind"] for m in c.models.list().data}  # type: ignore[index]
    assert listed == {"tiny": "generate", "minilm": "embed", "classifier": "custom"}
    out = c.completions.create(model="tiny", prompt="the cat", max_tokens=3, temperature=0)
    assert out.model == "tiny" and out.usage is not None and out.usage.completion_tokens == 3
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.model == "tiny" and chat.choices[0].finish_reason == "length"
    emb = c.embeddings.create(model="minilm", input=["a red fox", "the moon"])
    assert emb.model == "minilm" and [len(d.embedding) for d in emb.data] == [384, 384]
    assert [d.index for d in emb.data] == [0, 1] and emb.usage.prompt_tokens > 0
    norm = sum(x * x for x in emb.data[0].embedding)
    assert abs(norm - 1.0) < 1e-4  # MiniLM's config normalizes
    body = {"instances": [{"text": "hi"}, {"text": "three"}]}
    pred = httpx.post(f"{fleet.url}/v1/models/classifier:predict", json=body, timeout=30)
    assert pred.status_code == 200
    assert pred.json() == {
        "predictions": [{"label": "even", "length": 2}, {"label": "odd", "length": 5}]
    }
    values = scrape(fleet.url)
    for name in ("minilm", "classifier"):
        assert metric(values, "fleetserve:batch_size_count", model_name=name) >= 1


def test_a_model_of_another_kind_is_400_naming_it(fleet: ServerProc) -> None:
    c = client(fleet)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "wrong_model_kind" and e.value.param == "model"
    assert "'minilm' is a embed model; this endpoint serves generate models" in e.value.message
    with pytest.raises(openai.BadRequestError, match="'tiny' is a generate model"):
        c.embeddings.create(model="tiny", input="x")
    r = httpx.post(f"{fleet.url}/v1/models/minilm:predict", json={"instances": [{}]})
    assert r.status_code == 400 and "'minilm' is a embed model" in r.json()["error"]["message"]
    r = httpx.post(f"{fleet.url}/v1/models/nope:predict", json={"instances": [{}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="nope", input="x")


def test_unknown_model_class_and_refused_priority(fleet: ServerProc) -> None:
    c = client(fleet)
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="nope", prompt="x", max_tokens=1)
    assert nf.value.code == "model_not_found" and "'nope'" in nf.value.message
    assert "'tiny' (generate)" in nf.value.message
    with pytest.raises(openai.BadRequestError, match="service_tier 'gold' is not a service class"):
        c.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_headers={"X-Fleetserve-Class": "gold"}
        )
    with pytest.raises(openai.BadRequestError, match="service_tier 'gold' is not a service class"):
        c.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"service_tier": "gold"}
        )
    # The same class by header and body is fine; two different ones are refused.
    c.completions.create(
        model="tiny", prompt="x", max_tokens=1, extra_body={"service_tier": "batch"},
        extra_headers={"X-Fleetserve-Class": "batch"},
    )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="service_tier"):
        c.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"service_tier": "batch"},
            extra_headers={"X-Fleetserve-Class": "interactive"},
        )  # fmt: skip
    # priority is honoured under the priority policy (a fleet's default).
    c.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"priority": 3})


def test_priority_is_refused_not_ignored_under_fcfs(server: ServerProc) -> None:
    """The shared single-model server runs the default fcfs policy."""
    c = client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert bad.value.param == "priority" and "first-come first-served" in bad.value.message
    c.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"priority": 0})


class Timeline:
    """Client-side times of each request's send, first token and end."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.status: dict[str, int] = {}

    async def stream(self, ac: httpx.AsyncClient, rid: str, cls: str, max_tokens: int) -> None:
        body = {"model": "tiny", "prompt": f"{rid} the", "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        self.sent[rid] = time.monotonic()
        headers = {"X-Fleetserve-Class": cls}
        async with ac.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            self.status[rid] = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    self.tokens[rid] = int(usage["completion_tokens"])
                elif rid not in self.first:
                    self.first[rid] = time.monotonic()

    def overtakes(self, probe: str, flood: list[str]) -> int:
        """Flood requests not started when `probe` was sent that started before it did."""
        sent, first = self.sent[probe], self.first[probe]
        return sum(1 for f in flood if sent < self.first.get(f, float("inf")) < first)


async def flood_and_probe(
    url: str, flood_cls: str, probe_cls: str, num_probes: int, tail: int = 0
) -> tuple[Timeline, list[str], list[str], list[httpx.Response]]:
    tl = Timeline()
    flood = [f"flood{i}" for i in range(FLOOD)]
    probes = [f"probe{i}" for i in range(num_probes)]
    async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
        tasks = [asyncio.ensure_future(tl.stream(ac, f, flood_cls, FLOOD_TOKENS)) for f in flood]
        # The flood is in once two of it run and the rest wait.
        while len(tl.first) < 2:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        tail_body = {"model": "tiny", "prompt": "tail", "max_tokens": 2}
        tails = [
            asyncio.ensure_future(
                ac.post("/v1/completions", json=tail_body, headers={"X-Fleetserve-Class": "tail"})
            )
            for _ in range(tail)
        ]
        for p in probes:
            await tl.stream(ac, p, probe_cls, 2)
            await asyncio.sleep(0.1)
        tail_responses = list(await asyncio.gather(*tails))
        await asyncio.gather(*tasks)
    return tl, flood, probes, tail_responses


def test_interactive_overtakes_a_batch_flood_which_still_completes(fleet: ServerProc) -> None:
    # One class for all: a probe waits behind the queued flood (first come, first served).
    tl, flood, probes, _ = asyncio.run(flood_and_probe(fleet.url, "interactive", "interactive", 1))
    assert tl.overtakes(probes[0], flood) >= 3
    # Classes: each probe goes ahead of every queued batch request, and the flood completes.
    waiting: list[float] = []

    async def watch() -> None:
        while len(waiting) < 1:
            values = await asyncio.to_thread(scrape, fleet.url)
            n = metric(
                values, "fleetserve:num_requests_waiting", model_name="tiny", **{"class": "batch"}
            )
            if n > 0:
                waiting.append(n)
            await asyncio.sleep(0.05)

    async def both() -> Any:
        w = asyncio.ensure_future(watch())
        try:
            return await flood_and_probe(fleet.url, "batch", "interactive", 4, tail=4)
        finally:
            w.cancel()

    tl, flood, probes, tails = asyncio.run(both())
    assert sum(tl.overtakes(p, flood) for p in probes) <= 1  # 0, but for client-side jitter
    assert all(tl.status[f] == 200 and tl.tokens[f] == FLOOD_TOKENS for f in flood)
    assert all(tl.status[p] == 200 and tl.tokens[p] == 2 for p in probes)
    assert waiting and waiting[0] >= 1
    # The tail class (max_waiting 1, max_queue_time_s 1) under the same flood: one waits and
    # is shed after its queue time, three are refused at once; none reached the engine.
    codes = sorted(r.json()["error"]["code"] for r in tails)
    assert [r.status_code for r in tails] == [503] * 4
    assert codes == ["overloaded"] * 3 + ["queue_timeout"]
    assert all(r.headers["Retry-After"].isdigit() for r in tails)
    values = scrape(fleet.url)
    shed = "fleetserve:requests_shed_total"
    assert metric(values, shed, model_name="tiny", reason="queue_full", **{"class": "tail"}) == 3
    assert metric(values, shed, model_name="tiny", reason="queue_timeout", **{"class": "tail"}) == 1
    assert wait_until(
        lambda: (
            metric(scrape(fleet.url), "fleetserve:num_requests_waiting", model_name="tiny") == 0
        ),
        10,
    )
    ttft = "fleetserve:time_to_first_token_seconds_count"
    assert metric(values, ttft, model_name="tiny", **{"class": "interactive"}) >= 4
    assert metric(values, ttft, model_name="tiny", **{"class": "batch"}) >= FLOOD


def test_health_live_ready(fleet: ServerProc) -> None:
    for path in ("/health", "/live", "/ready"):
        assert httpx.get(f"{fleet.url}{path}").status_code == 200
