"""LoRA adapters over HTTP with the real `openai` client: a request names its adapter as
the model, /v1/models lists adapters with their parent, adapters are loaded and unloaded
while serving (admin routes behind the API key), an unknown one is a 404 naming it, and
a request in flight finishes after its adapter is unloaded. A fleet of two replicas
routes an adapter's requests to the replica that holds it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_proc import ServerProc, scrape

from lora_helpers import make_adapter, offline_text

KEY = "lora-test-key"
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89]


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-http")
    return {
        "a": make_adapter(tiny_llama, root / "a", 21),
        "b": make_adapter(tiny_llama, root / "b", 22, r=4, targets=["q_proj", "v_proj"]),
        "big": make_adapter(tiny_llama, root / "big", 23, r=16, targets=["q_proj"]),
    }


@pytest.fixture(scope="module")
def server(tiny_llama: str, adapters: dict[str, str]) -> Iterator[ServerProc]:
    proc = ServerProc(
        tiny_llama, "--served-model-name", "tiny", "--api-key", KEY, "--enable-lora",
        "--lora-modules", f"a={adapters['a']}", "--max-loras", "2", "--max-lora-rank", "8",
        "--num-threads", "1",
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


def _admin(
    server: ServerProc, path: str, body: dict[str, str], key: str | None = KEY
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _text(client: openai.OpenAI, model: str, max_tokens: int = 10) -> str:
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return resp.choices[0].text


def _offline_text(base: str, adapter: str | None) -> str:
    return offline_text(base, adapter, PROMPT)


def test_models_lists_adapters_with_parent(client: openai.OpenAI, adapters: dict[str, str]) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "a"}
    assert cards["a"].model_extra["parent"] == "tiny"  # type: ignore[index]
    assert cards["a"].model_extra["root"] == adapters["a"]  # type: ignore[index]


def test_adapter_named_as_model_matches_peft(
    client: openai.OpenAI, tiny_llama: str, adapters: dict[str, str]
) -> None:
    assert _text(client, "a") == _offline_text(tiny_llama, adapters["a"])
    assert _text(client, "tiny") == _offline_text(tiny_llama, None)
    assert _text(client, "a") != _text(client, "tiny")
    resp = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert resp.model == "a"


def test_the_load_report_lists_the_adapters_held(server: ServerProc) -> None:
    """What a gateway reads from this server as a pod (serve/remote/wire.py LOAD_PATH): the
    preloaded adapter is listed, so the gateway routes its requests here."""
    from fleetserve.serve.remote.wire import LOAD_PATH

    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{server.url}{LOAD_PATH}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert "a" in r.json()["lora_adapters"]


def test_unknown_adapter_is_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_load_and_unload_over_http(
    server: ServerProc,
    client: openai.OpenAI,
    tiny_llama: str,
    adapters: dict[str, str],
    tmp_path: Path,
) -> None:
    body = {"lora_name": "b", "lora_path": adapters["b"]}
    assert _admin(server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    r = _admin(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert r.json()["parent"] == "tiny"
    assert "b" in {m.id for m in client.models.list().data}
    assert _text(client, "b") == _offline_text(tiny_llama, adapters["b"])
    # Refusals name the problem.
    r = _admin(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = _admin(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "not a PEFT adapter folder" in r.json()["error"]["message"]
    r = _admin(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["big"]})
    assert r.status_code == 400 and "max_lora_rank=8" in r.json()["error"]["message"]
    r = _admin(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/p", "extra": 1})
    assert r.status_code == 400 and "extra" in r.json()["error"]["message"]
    # Unloading with a request in flight: it finishes with every token.
    stream = client.completions.create(
        model="b", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)
    r = _admin(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200, r.text
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
    assert finish[-1] == "length"
    with pytest.raises(openai.NotFoundError, match="'b'"):
        client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
    r = _admin(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 404 and "'b'" in r.json()["error"]["message"]


def test_per_adapter_metrics(server: ServerProc, client: openai.OpenAI) -> None:
    _text(client, "a", max_tokens=3)
    values = scrape(server.url, {"Authorization": f"Bearer {KEY}"})
    assert values['fleetserve:lora_requests_total{lora_name="a",model_name="tiny"}'] >= 1
    assert values['fleetserve:lora_generation_tokens_total{lora_name="a",model_name="tiny"}'] >= 3
    assert values['fleetserve:lora_loads_total{lora_name="a",model_name="tiny"}'] >= 1


# ------------------------------------------------------------- a fleet of two replicas
def test_fleet_routes_an_adapter_to_its_holder(
    tiny_llama: str, adapters: dict[str, str], tmp_path: Path
) -> None:
    """Four concurrent streams of adapter "b" all go to the replica that loaded it (the
    least-loaded policy alone would spread them); base-model streams spread."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"""models:
  - name: tiny
    model: {tiny_llama}
    replicas: 2
    adapters: {{b: {adapters["b"]}}}
    engine: {{max_loras: 1, max_lora_rank: 8, max_cpu_loras: 1, num_threads: 2}}
"""
    )
    proc = ServerProc(None, "--config", str(fleet)).wait_ready()
    try:
        with openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0) as c:
            # max_cpu_loras 1: "b" is preloaded in both engines at start; a fresh
            # adapter decides the placement.
            r = httpx.post(f"{proc.url}/v1/load_lora_adapter",
                           json={"lora_name": "a", "lora_path": adapters["a"]}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            streams = [
                c.completions.create(
                    model="a",
                    prompt=PROMPT,
                    max_tokens=30,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for _ in range(4)
            ]
            for s in streams:
                assert sum(1 for _ in s) > 0
            views = httpx.get(f"{proc.url}/admin/replicas", timeout=10).json()["data"]
            holders = [v["index"] for v in views if "a" in v["lora_adapters"]]
            assert len(holders) == 1, views
            values = scrape(proc.url)
            assert values['fleetserve:lora_loads_total{lora_name="a",model_name="tiny"}'] == 1
    finally:
        proc.stop()


# `serve --ray` with an adapter (a request naming it reaches its replica's engine with it):
# tests/server/test_server_ray.py, in the same `serve --ray` run as the exit-code checks.
