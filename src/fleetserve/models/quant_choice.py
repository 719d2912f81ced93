"""Which quantization a model gets (models/quantize.py's module docstring has the kinds
and the defaults), and whether its matmuls take int8 activations. Imports no torch: the API
process resolves an engine's config with it; the C kernels are loaded only where a
quantized choice depends on them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable
from typing import TYPE_CHECKING

from fleetserve.config import dtype_name
from fleetserve.say_once import say_once

if TYPE_CHECKING:
    import torch

QUANTIZATIONS = ("none", "gguf", "int8")
INT8_ACTIVATIONS_ENV = "FLEETSERVE_INT8_ACTIVATIONS"

log = logging.getLogger(__name__)


def resolve_quantization(
    requested: str | None,
    source_format: str,
    dtype: str | torch.dtype,
    device: str,
    world_size: int,
) -> str:
    """The quantization a model gets; ValueError when ``requested`` cannot be honoured.
    The C kernels (and torch) are loaded only where quantized weights may be chosen."""

    def usable() -> bool:
        from fleetserve.kernels import library

        return (
            device == "cpu"
            and dtype_name(dtype) == "float32"
            and world_size == 1
            and library.open_library() is not None
        )

    if requested is None:
        return "gguf" if source_format == "gguf" and usable() else "none"
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {requested!r}")
    if requested == "none":
        return requested
    if requested == "gguf" and source_format != "gguf":
        raise ValueError("quantization='gguf' needs a .gguf checkpoint; try 'int8'")
    if world_size != 1:
        raise ValueError(
            f"quantization={requested!r} runs in one process: tensor/pipeline parallelism "
            "of quantized weights is not supported (use quantization='none')"
        )
    if not usable():
        raise ValueError(
            f"quantization={requested!r} needs device='cpu', dtype='float32' and a C compiler"
        )
    return requested


def resolve_int8_activations(requested: bool | None, quantization: str) -> bool:
    """Whether decode-sized matmuls quantize their inputs to int8; ValueError when
    ``requested`` cannot be honoured. None: the default (module docstring)."""
    if requested is None:
        if quantization == "none":
            return False
        env = os.environ.get(INT8_ACTIVATIONS_ENV)
        if env is not None and env not in ("0", "1"):
            raise ValueError(f"{INT8_ACTIVATIONS_ENV} must be 0 or 1, got {env!r}")
        from fleetserve.kernels.library import int8_dot_kernel

        kernel = int8_dot_kernel()
        if env is not None:
            on, why = env == "1", f"{INT8_ACTIVATIONS_ENV}={env}"
        elif quantization == "gguf" and kernel == "AVX-512 VNNI":
            on, why = True, f"{kernel} integer dot products; --no-int8-activations or "
            why += f"{INT8_ACTIVATIONS_ENV}=0 keeps float32 activations"
        else:
            on = False
            why = (
                "int8 weights: W8A8 is asked for explicitly" if quantization == "int8"
                else f"no AVX-512 VNNI build here ({kernel or 'plain C'} integer kernel)"
            )  # fmt: skip
        _say(f"int8 activations {'on' if on else 'off'} for {quantization} weights ({why})")
        return on
    if requested and quantization == "none":
        raise ValueError(
            "int8_activations=True needs quantized weights (quantization='gguf' or 'int8')"
        )
    return requested


_said: set[Hashable] = set()


def _say(message: str) -> None:
    """One INFO line per process and message (fleetserve/say_once.py)."""
    say_once(log, _said, message, message)
