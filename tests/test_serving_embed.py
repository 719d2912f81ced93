"""The /v1/embeddings and :predict handlers in an in-process FastAPI app (no server process:
the fleet's server tests drive the real one with the `openai` client).

One event loop runs in a background thread for the whole module (an anyio blocking portal),
so MiniLM loads once and each service's batcher stays on the loop it was started on.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Iterator
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import httpx
import numpy as np
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from fastapi import FastAPI, Request
from fastapi.responses import Response

from fleetserve.engine.embedding import MINILM_NAME
from fleetserve.entrypoints.openai.errors import APIError, error_response
from fleetserve.entrypoints.openai.protocol_embed import EmbeddingRequest, PredictRequest
from fleetserve.entrypoints.openai.serving_common import parse, read_json
from fleetserve.entrypoints.openai.serving_embedding import create_embedding
from fleetserve.entrypoints.openai.serving_predict import predict
from fleetserve.serve.microbatch.batcher import MicroBatchConfig
from fleetserve.serve.microbatch.services import CustomService, EmbedService


class Fleet:
    def __init__(self) -> None:
        self.batch_sizes: list[int] = []
        self.embed = EmbedService(
            "minilm",
            MINILM_NAME,
            batching=MicroBatchConfig(max_batch_size=16, batch_wait_timeout_s=0.05),
            on_batch=lambda n, s: self.batch_sizes.append(n),
        )
        self.custom = CustomService(
            "clf",
            "fleet_handlers:Classifier",
            options={"labels": ["a", "b"]},
            batching=MicroBatchConfig(max_batch_size=4, batch_wait_timeout_s=0.05),
        )
        self.app = _app(self)

    async def post(self, path: str, body: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)


def _app(fleet: Fleet) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = parse(EmbeddingRequest, await read_json(request, 1 << 20, 15.0))
        return await create_embedding(fleet.embed, body)

    @app.post("/v1/models/{name}:predict")
    async def predict_route(name: str, request: Request) -> dict[str, Any]:
        if name != fleet.custom.name:
            raise APIError(404, f"the model {name!r} does not exist", "model")
        body = parse(PredictRequest, await read_json(request, 1 << 20, 15.0))
        return await predict(fleet.custom, body)

    return app


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal() as p:
        yield p


@pytest.fixture(scope="module")
def fleet(portal: BlockingPortal) -> Iterator[Fleet]:
    f = Fleet()
    portal.call(f.embed.start)
    portal.call(f.custom.start)
    yield f
    portal.call(f.embed.shutdown)
    portal.call(f.custom.shutdown)


def post(portal: BlockingPortal, fleet: Fleet, path: str, body: Any) -> httpx.Response:
    return portal.call(fleet.post, path, body)


def test_float_and_base64_vectors_equal_the_model(portal: BlockingPortal, fleet: Fleet) -> None:
    texts = ["Hello world", "Dynamic batching pays off under load."]
    expected = fleet.embed.model.embed(texts)
    r = post(portal, fleet, "/v1/embeddings", {"model": "minilm", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, expected.vectors, atol=1e-6)
    n = sum(expected.num_tokens)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}

    r = post(
        portal,
        fleet,
        "/v1/embeddings",
        {"model": "minilm", "input": texts, "encoding_format": "base64", "user": "u1"},
    )
    assert r.status_code == 200, r.text
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]
    ]
    np.testing.assert_allclose(np.stack(decoded), expected.vectors, atol=1e-6)


def test_token_id_inputs(portal: BlockingPortal, fleet: Fleet) -> None:
    ids = fleet.embed.model.tokenizer("Hello world")["input_ids"]
    text_vec = fleet.embed.model.embed(["Hello world"]).vectors[0]
    for payload, count in ((ids, 1), ([ids, ids], 2)):
        r = post(portal, fleet, "/v1/embeddings", {"model": "minilm", "input": payload})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == count
        np.testing.assert_allclose(data[-1]["embedding"], text_vec, atol=1e-6)
        assert r.json()["usage"]["prompt_tokens"] == count * len(ids)


def test_dimensions_is_refused_unless_it_is_the_models(
    portal: BlockingPortal, fleet: Fleet
) -> None:
    ok = post(portal, fleet, "/v1/embeddings", {"model": "m", "input": "x", "dimensions": 384})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384
    r = post(portal, fleet, "/v1/embeddings", {"model": "m", "input": "x", "dimensions": 128})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "dimensions"
    assert "384-dimensional" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (
            {"model": "m", "input": "x", "truncate": True},
            "truncate",
            "truncate is not supported by fleetserve",
        ),
        ({"model": "m", "input": []}, "input", "must not be empty"),
        ({"model": "m", "input": ["a", ""]}, "input", "input[1] is an empty string"),
        ({"model": "m", "input": [[101], []]}, "input", "input[1] is an empty list"),
        ({"model": "m", "input": [101, 99999]}, "input", "token id 99999"),
        ({"model": "m", "input": [101, -5]}, "input", "token id -5"),
        ({"model": "m", "input": [1, True]}, "input", "list of token ids"),
        ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ({"model": "m", "input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": "x"}, "model", "model is required"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    portal: BlockingPortal, fleet: Fleet, body: dict[str, Any], param: str, fragment: str
) -> None:
    r = post(portal, fleet, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"]


def test_items_of_concurrent_requests_share_batches(portal: BlockingPortal, fleet: Fleet) -> None:
    async def burst() -> list[httpx.Response]:
        bodies = [{"model": "m", "input": [f"sentence {i}", f"another {i}"]} for i in range(8)]
        return await asyncio.gather(*(fleet.post("/v1/embeddings", b) for b in bodies))

    fleet.batch_sizes.clear()
    responses = portal.call(burst)
    assert all(r.status_code == 200 for r in responses)
    assert sum(fleet.batch_sizes) == 16
    assert max(fleet.batch_sizes) > 2  # more than one request's items in a batch
    vec = fleet.embed.model.embed(["another 5"]).vectors[0]
    np.testing.assert_allclose(responses[5].json()["data"][1]["embedding"], vec, atol=1e-5)


def test_predict_answers_and_a_failing_instance_fails_its_request_only(
    portal: BlockingPortal, fleet: Fleet
) -> None:
    async def burst() -> list[httpx.Response]:
        bodies = [
            {"instances": [{"text": "hi"}]},
            {"instances": [{"text": "ok"}, {"text": "boom"}]},
            {"instances": [{"text": "hey"}]},
        ]
        return await asyncio.gather(*(fleet.post("/v1/models/clf:predict", b) for b in bodies))

    good, bad, other = portal.call(burst)
    assert good.status_code == 200 and good.json() == {"predictions": [{"label": "a", "length": 2}]}
    assert other.status_code == 200 and other.json()["predictions"][0]["length"] == 3
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "instances.1"
    assert err["message"] == "instances[1]: cannot classify 'boom'"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"instances": []}, "instances"),
        ({"instances": [1, 2]}, "instances.0"),
        ({"instances": [{}], "inputs": {"text": ["a"]}}, "inputs"),
    ],
)
def test_bad_predict_bodies_are_400(
    portal: BlockingPortal, fleet: Fleet, body: dict[str, Any], param: str
) -> None:
    r = post(portal, fleet, "/v1/models/clf:predict", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_handler_bug_is_500_and_not_ready_is_503(portal: BlockingPortal) -> None:
    fleet = Fleet()
    fleet.custom = CustomService("clf", "fleet_handlers:Crashy")

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        before = await fleet.post("/v1/models/clf:predict", {"instances": [{}]})
        await fleet.custom.start()
        crash = await fleet.post("/v1/models/clf:predict", {"instances": [{"crash": True}]})
        return before, crash

    before, crash = portal.call(scenario)
    assert before.status_code == 503 and before.headers["retry-after"] == "1"
    assert before.json()["error"]["code"] == "loading"
    assert crash.status_code == 500
    assert crash.json()["error"]["message"] == "instances[0] failed: crash"
    r = post(portal, fleet, "/v1/embeddings", {"model": "m", "input": "x"})
    assert r.status_code == 503  # this fleet's embed service was never started


def test_the_openai_client_reads_the_response(portal: BlockingPortal, fleet: Fleet) -> None:
    """The official client asks for base64 by default and decodes it; both forms parse."""
    import openai

    async def call() -> tuple[Any, Any]:
        transport = httpx.ASGITransport(app=fleet.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
            client = openai.AsyncOpenAI(
                api_key="x", base_url="http://test/v1", http_client=http, max_retries=0
            )
            default = await client.embeddings.create(model="minilm", input=["a b", "c"])
            floats = await client.embeddings.create(
                model="minilm", input="a b", encoding_format="float"
            )
            return default, floats

    default, floats = portal.call(call)
    result = fleet.embed.model.embed(["a b", "c"])
    expected = result.vectors
    assert result.num_tokens == [4, 3]  # [CLS] a b [SEP], [CLS] c [SEP]
    assert [d.index for d in default.data] == [0, 1]
    np.testing.assert_allclose(np.array(default.data[0].embedding), expected[0], atol=1e-6)
    np.testing.assert_allclose(np.array(floats.data[0].embedding), expected[0], atol=1e-6)
    assert default.usage.prompt_tokens == 7 and default.model == "minilm"
