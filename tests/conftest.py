"""Session-wide random checkpoints, built once per test session into a temp folder."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fleetserve.models.make_model import make_model
from helpers import freeze


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`factory(arch, **overrides) -> checkpoint folder`, cached by its arguments.

    `overrides` go to `make_model`: config fields, `seed`, `max_shard_size`.
    """
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[tuple, str] = {}

    def factory(arch: str = "llama", **overrides: object) -> str:
        key = (arch, freeze(overrides))
        if key not in built:
            out = root / f"{arch}-{len(built)}"
            built[key] = make_model(str(out), arch, "tiny", **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("qwen3")
