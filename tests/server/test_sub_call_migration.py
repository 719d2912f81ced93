"""A handler's streamed sub-call whose replica is killed (-9) mid-stream moves to the
callee's other replica and the handler gets the whole, correct answer: sub-calls go
through the callee's own service, migration included. Only the replica this test picks
(a pid the server reports) is signalled."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_proc import ServerProc, metric, scrape, wait_until

pytestmark = pytest.mark.slow  # its own two-replica fleet: ~30 s

MAX_TOKENS = 80
CONFIG = """
models:
  - name: tiny
    model: {model}
    replicas: 2
    engine: {{max_num_seqs: 4, num_threads: 1, max_model_len: 512}}
  - name: streamer
    kind: custom
    handler: pipeline_handlers:StreamComplete
    options: {{model: tiny}}
    timeout_s: 60.0
"""


@pytest.fixture(scope="module")
def fleet(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    config = CONFIG.format(model=tiny_llama)
    env = {"FLEETSERVE_DEBUG_STEP_DELAY_S": "0.03"}
    srv = ServerProc.fleet(config, tmp_path_factory.mktemp("subcall-migration"), env)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def replicas(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/admin/replicas", timeout=10).json()["data"]  # type: ignore[no-any-return]


def test_a_streamed_sub_call_whose_replica_dies_migrates(fleet: ServerProc) -> None:
    url = fleet.url
    params = {"ignore_eos": True}
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
        direct = c.completions.create(model="tiny", prompt="The sea", max_tokens=MAX_TOKENS,
                                      temperature=0.0, extra_body=params)  # fmt: skip
    assert direct.usage is not None and direct.usage.completion_tokens == MAX_TOKENS
    migrated = metric(scrape(url), "fleetserve:request_migrations_total", model_name="tiny")
    result: list[httpx.Response] = []
    body = {"instances": [{"prompt": "The sea", "max_tokens": MAX_TOKENS, "params": params}]}
    parent = threading.Thread(target=lambda: result.append(
        httpx.post(f"{url}/v1/models/streamer:predict", json=body, timeout=120)))  # fmt: skip
    parent.start()
    busy: list[int] = []

    def pick() -> bool:
        busy[:] = [r["pid"] for r in replicas(url) if r["state"] == "ready" and r["num_requests"]]
        return bool(busy)

    assert wait_until(pick, 30), replicas(url)
    os.kill(busy[0], signal.SIGKILL)
    parent.join(120)
    (r,) = result
    assert r.status_code == 200, r.text
    (pred,) = r.json()["predictions"]
    assert pred["text"] == direct.choices[0].text  # whole, nothing lost or repeated
    after = metric(scrape(url), "fleetserve:request_migrations_total", model_name="tiny")
    assert after - migrated >= 1
