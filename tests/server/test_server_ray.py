"""`fleetserve serve --ray`: the command starts a local Ray, serves the fleet of its flags
through Ray Serve's proxy with the local server's auth, and exits 0 on SIGTERM."""

from __future__ import annotations

import openai
import pytest
from server_proc import ServerProc

pytestmark = pytest.mark.slow


def test_serve_on_ray_answers_and_exits_cleanly(tiny_llama: str) -> None:
    pytest.importorskip("ray")
    srv = ServerProc(
        tiny_llama,
        "--ray",
        "--served-model-name", "tiny",
        "--api-key", "k",
        "--num-threads", "1",
        "--max-model-len", "256",
    )  # fmt: skip
    try:
        srv.wait_ready(timeout_s=300)
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k", max_retries=0, timeout=120)
        out = c.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 5
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        code = srv.stop(timeout_s=60)
    assert code == 0, srv.final_output
