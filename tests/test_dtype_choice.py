"""`--dtype auto`: the chooser over CPU-flag sets, and the one start-up line that says what
it chose and why (engine/dtype_choice.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from fleetserve.engine import dtype_choice
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.dtype_choice import choose_dtype

ZEN4 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_int8", "amx_tile", "avx512_fp16"}
ICE_LAKE = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"})
HASWELL = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (SAPPHIRE_RAPIDS, "amx_bf16/avx512_bf16/avx512_fp16, but fleetserve's C kernels"),
        (ZEN4, "has avx512_bf16, but"),
        (ICE_LAKE, "(AVX-512) has no native bf16/fp16"),
        (HASWELL, "(AVX2) has no native"),
        (frozenset(), "(no AVX2) has no native"),
    ],
)
def test_float32_on_every_cpu_until_a_native_16_bit_path_exists(flags, says):
    for stored in ("float32", "bfloat16", "float16", None):
        choice = choose_dtype(stored, flags, "cpu")
        assert choice.dtype == "float32"
        assert says in choice.reason
        assert choice.reason.startswith(f"{stored} checkpoint" if stored else "checkpoint")


def test_other_devices_keep_float32():
    assert choose_dtype("bfloat16", ZEN4, "cuda").dtype == "float32"


def test_cpu_flags_reads_this_machine():
    flags = dtype_choice.cpu_flags()
    assert isinstance(flags, frozenset)
    if flags:  # Linux: the x86 or arm flag names, never the "flags" label itself
        assert "flags" not in flags and ":" not in flags


def test_auto_is_the_default_and_is_said_once(tiny_llama, caplog, monkeypatch):
    monkeypatch.setattr(dtype_choice, "_announced", set())
    caplog.set_level(logging.INFO, logger="fleetserve.engine.dtype_choice")
    assert EngineArgs().dtype == "auto"
    for _ in range(2):
        config, _ = EngineArgs(model=tiny_llama).resolve()
        assert config.model.dtype == torch.float32
    lines = [r.getMessage() for r in caplog.records if r.name == dtype_choice.__name__]
    assert len(lines) == 1 and lines[0].startswith("dtype auto -> float32 (")
    # An explicit dtype is taken as given, with nothing to say.
    config, _ = EngineArgs(model=tiny_llama, dtype="bfloat16").resolve()
    assert config.model.dtype == torch.bfloat16
    assert len([r for r in caplog.records if r.name == dtype_choice.__name__]) == 1
