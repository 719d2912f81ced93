"""Fuzz stage: schemathesis generates request bodies from the server's own /openapi.json
(valid ones and, in negative mode, ones that break the schema) for every POST endpoint.

Asserted for every case: no 5xx, every error in OpenAI's error shape, every answer within a
few seconds. Afterwards the admission bound must be whole again (as many concurrent good
requests as --max-waiting-requests are all served) and the queue gauges back at 0.
Bounded: a fixed number of cases per endpoint and mode, derandomized (fixed seed)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_proc import ServerProc, metric, scrape, wait_until

pytestmark = pytest.mark.slow

WAITING_BOUND = 3
CASES_PER_MODE = 120
MAX_SECONDS = 10.0
# Bodies the schema allows but that would only measure the tiny model's speed are kept
# small by the server's own limits: a short max_model_len bounds every generation.
SERVER_ARGS = ("--max-model-len", "64", "--max-num-seqs", "4",
               "--max-waiting-requests", str(WAITING_BOUND))  # fmt: skip


@pytest.fixture(scope="module")
def srv(tiny_llama: str) -> Iterator[ServerProc]:
    s = ServerProc(tiny_llama, "--served-model-name", "tiny", *SERVER_ARGS)
    try:
        s.wait_ready()
        # The first generation pays one-off costs (thread pools, first-touch pages).
        warm = {"prompt": "warm up", "max_tokens": 8, "logprobs": 2}
        assert httpx.post(f"{s.url}/v1/completions", json=warm, timeout=60).status_code == 200
        yield s
    finally:
        code = s.stop()
        assert code == 0, s.final_output


def _encode(body: object) -> bytes:
    """The case's body as sent: negative mode also makes raw bytes, or no body at all."""
    if isinstance(body, bytes):
        return body
    if not isinstance(body, (dict, list, str, int, float, bool, type(None))):
        return b""  # schemathesis' NotSet: no body
    return json.dumps(body).encode()


def _check(case: schemathesis.Case, response: httpx.Response, elapsed: float) -> None:
    where = f"{case.method} {case.path} body={_encode(case.body)[:500]!r}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:500]}"
    assert elapsed < MAX_SECONDS, f"{where} took {elapsed:.1f} s"
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/json"), where
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"], where
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", where
    else:
        assert "choices" in response.json(), where


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    # One client for every case: a new one per request (httpx.post) builds an SSL context,
    # ~25 ms of CPU each, more than the case's own generation.
    with httpx.Client(timeout=MAX_SECONDS * 4) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))
def test_fuzz_endpoint(
    srv: ServerProc, client: httpx.Client, path: str, mode: schemathesis.GenerationMode
) -> None:
    spec = client.get(f"{srv.url}/openapi.json").json()
    operation = schemathesis.openapi.from_dict(spec)[path]["POST"]
    counts: dict[int, int] = {}

    @settings(
        max_examples=CASES_PER_MODE,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        t0 = time.monotonic()
        response = client.post(
            f"{srv.url}{path}",
            content=_encode(case.body),
            headers={"Content-Type": "application/json"},
        )
        _check(case, response, time.monotonic() - t0)
        counts[response.status_code] = counts.get(response.status_code, 0) + 1

    run()
    print(
        f"fuzz {path} {mode.value}: {sum(counts.values())} cases, status {sorted(counts.items())}"
    )
    assert sum(counts.values()) >= CASES_PER_MODE // 2


def test_bound_and_gauges_whole_after_fuzzing(srv: ServerProc) -> None:
    def one(i: int) -> int:
        body = {"prompt": f"after the fuzz {i}", "max_tokens": 16, "ignore_eos": True}
        return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(WAITING_BOUND) as pool:
        assert list(pool.map(one, range(WAITING_BOUND))) == [200] * WAITING_BOUND

    def idle() -> bool:
        values = scrape(srv.url)
        return (
            metric(values, "fleetserve:num_requests_waiting") == 0
            and metric(values, "fleetserve:num_requests_running") == 0
        )

    assert wait_until(idle, 10)
    assert "Traceback" not in srv.output()
