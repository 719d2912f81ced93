"""`fleetserve serve --ray`: the command starts a local Ray, serves the fleet of its flags
through Ray Serve's proxy with the local server's auth, and exits 0 on SIGTERM."""

from __future__ import annotations

import openai
import pytest
from server_proc import ServerProc

from lora_helpers import make_adapter, offline_text

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89]


def test_serve_on_ray_answers_and_exits_cleanly(
    tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One `serve --ray` run (each costs a Ray start and a replica start): the base model
    and a LoRA adapter answer (a request naming the adapter reaches its replica's engine
    with it: its greedy text is peft's), auth holds, and SIGTERM exits 0."""
    pytest.importorskip("ray")
    adapter = make_adapter(tiny_llama, tmp_path_factory.mktemp("ray-lora") / "a", 21)
    srv = ServerProc(
        tiny_llama,
        "--ray",
        "--served-model-name", "tiny",
        "--api-key", "k",
        "--num-threads", "1",
        "--max-model-len", "256",
        "--enable-lora", "--lora-modules", f"a={adapter}", "--max-lora-rank", "8",
    )  # fmt: skip
    try:
        srv.wait_ready(timeout_s=300)
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k", max_retries=0, timeout=120)
        out = c.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 5
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        # LoRA on Ray (moved here from tests/server/test_server_lora.py).
        assert {m.id for m in c.models.list().data} == {"tiny", "a"}
        assert _text(c, "a") == offline_text(tiny_llama, adapter, PROMPT)
        assert _text(c, "tiny") == offline_text(tiny_llama, None, PROMPT)
        with pytest.raises(openai.NotFoundError, match="nope"):
            c.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    finally:
        code = srv.stop(timeout_s=60)
    assert code == 0, srv.final_output


def _text(client: openai.OpenAI, model: str) -> str:
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return resp.choices[0].text


def test_ctrl_c_stops_the_app_then_the_cluster_within_the_drain_timeout(tiny_llama: str) -> None:
    """Ctrl-C in a terminal: SIGINT to the whole process group (the driver and the Ray it
    started). The app is deleted, then the cluster stopped, and the command exits 0 well
    inside Ray's 60 s GCS timeout (before: over 60 s and a screen of errors)."""
    import os
    import signal
    import sys
    import time

    import psutil

    from fleetserve.bench.local_server import LocalServer, free_port

    pytest.importorskip("ray")
    port = free_port()
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "serve", "--ray",
           "--model", tiny_llama, "--served-model-name", "tiny", "--num-threads", "1",
           "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port),
           "--drain-timeout", "10"]  # fmt: skip
    srv = LocalServer(cmd, port, name="serve-ray", new_session=True)  # a terminal's group

    def in_session(p: psutil.Process) -> bool:
        try:
            return os.getsid(p.pid) == srv.proc.pid
        except OSError:
            return False

    try:
        srv.wait_ready(300)
        session = [p for p in psutil.process_iter() if in_session(p)]
        assert len(session) > 3  # the driver and the Ray cluster it started
        started = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGINT)
        code = srv.proc.wait(120)
        took = time.monotonic() - started
        out = srv.output()
    finally:
        srv.stop()
    assert code == 0, out[-3000:]
    assert out.index("application deleted") < out.index("Ray stopped"), out[-3000:]
    assert "Failed to connect to GCS" not in out
    # The drain timeout (10 s) plus Ray's own stop; generous for a loaded CI box.
    assert took < 40, (took, out[-3000:])
    assert not [p for p in session if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
