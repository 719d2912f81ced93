"""`--dtype auto`: the chooser over CPU-flag sets, and the one start-up line that says what
it chose and why (engine/dtype_choice.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from fleetserve.engine import dtype_choice
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.dtype_choice import choose_dtype
from helpers import write_tiny_gguf

ZEN4 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_int8", "amx_tile", "avx512_fp16"}
ICE_LAKE = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"})
HASWELL = frozenset({"avx2", "fma"})


@pytest.fixture
def auto_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto as shipped (tests/conftest.py keeps it float32 for the rest of the suite)."""
    monkeypatch.delenv(dtype_choice.AUTO_BF16_ENV, raising=False)


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, ZEN4])
def test_bf16_weights_where_the_cpu_has_native_bf16(flags, auto_bf16):
    for stored in ("float32", "bfloat16", None):
        choice = choose_dtype(stored, flags, "cpu")
        assert choice.dtype == "float32" and choice.bf16_weights
        assert choice.describe() == "float32 with bf16 weights"
        assert "avx512_bf16" in choice.reason and "--dtype float32 forces" in choice.reason
        assert choice.reason.startswith(f"{stored} checkpoint" if stored else "checkpoint")
    # A float16 checkpoint is not narrowed to bf16's mantissa.
    fp16 = choose_dtype("float16", flags, "cpu")
    assert fp16.dtype == "float32" and not fp16.bf16_weights and "mantissa" in fp16.reason


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (ICE_LAKE, "(AVX-512) has no native bf16/fp16"),
        (HASWELL, "(AVX2) has no native"),
        (frozenset(), "(no AVX2) has no native"),
        (frozenset({"avx512f", "avx512_fp16"}), "has avx512_fp16 but no bf16"),
    ],
)
def test_float32_on_cpus_without_native_bf16(flags, says, auto_bf16):
    for stored in ("float32", "bfloat16", "float16", None):
        choice = choose_dtype(stored, flags, "cpu")
        assert choice.dtype == "float32" and not choice.bf16_weights
        assert says in choice.reason
        assert choice.reason.startswith(f"{stored} checkpoint" if stored else "checkpoint")


def test_env_keeps_auto_float32(monkeypatch):
    monkeypatch.setenv(dtype_choice.AUTO_BF16_ENV, "0")
    choice = choose_dtype("float32", SAPPHIRE_RAPIDS, "cpu")
    assert not choice.bf16_weights and "FLEETSERVE_AUTO_BF16=0" in choice.reason


def test_other_devices_keep_float32(auto_bf16):
    choice = choose_dtype("bfloat16", ZEN4, "cuda")
    assert choice.dtype == "float32" and not choice.bf16_weights


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


def _resolve_lines(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, **kw):
    monkeypatch.setattr(dtype_choice, "_announced", set())
    caplog.clear()
    config, _ = EngineArgs(**kw).resolve()
    lines = [r.getMessage() for r in caplog.records if r.name == dtype_choice.__name__]
    return config, lines


def test_auto_runs_bf16_weights_on_a_bf16_cpu(
    tiny_llama, tiny_model_factory, caplog, monkeypatch, auto_bf16
):
    """What the engine gets from the choice: bf16 weights on a float32 model where they
    can run, plain float32 (said why) where a setting rules them out, nothing said for an
    explicit dtype."""
    from fleetserve.kernels import bf16 as bf16_kernels
    from fleetserve.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None or not bf16_kernels.native():
        pytest.skip("kernel library without AVX512-BF16 here")
    monkeypatch.setattr("fleetserve.engine.arg_utils.cpu_flags", lambda: SAPPHIRE_RAPIDS)
    caplog.set_level(logging.INFO, logger="fleetserve.engine.dtype_choice")
    config, lines = _resolve_lines(caplog, monkeypatch, model=tiny_llama)
    assert config.model.dtype == torch.float32 and config.bf16_weights
    assert len(lines) == 1 and lines[0].startswith("dtype auto -> float32 with bf16 weights (")
    config, lines = _resolve_lines(caplog, monkeypatch, model=tiny_llama, quantization="int8")
    assert not config.bf16_weights and config.kv_dtype == torch.bfloat16
    assert lines[0].startswith("dtype auto -> float32 with a bf16 KV cache (")
    assert "int8 weights keep their quantized path" in lines[0]
    for kw, why in [
        ({"bf16_weights": False}, "bf16 weights turned off"),
        ({"attention_backend": "torch"}, "torch attention backend"),
        ({"tensor_parallel_size": 2}, "tensor/pipeline-parallel"),
    ]:
        config, lines = _resolve_lines(caplog, monkeypatch, model=tiny_llama, **kw)
        assert not config.bf16_weights, kw
        assert lines[0].startswith("dtype auto -> float32 (") and why in lines[0], lines
    config, lines = _resolve_lines(caplog, monkeypatch, model=tiny_llama, dtype="float32")
    assert not config.bf16_weights and lines == []
    # An explicit True stands whatever the CPU.
    monkeypatch.setattr("fleetserve.engine.arg_utils.cpu_flags", lambda: HASWELL)
    config, _ = _resolve_lines(caplog, monkeypatch, model=tiny_llama, bf16_weights=True)
    assert config.bf16_weights
    config, lines = _resolve_lines(caplog, monkeypatch, model=tiny_llama)
    assert not config.bf16_weights and "(AVX2) has no native" in lines[0]


def test_auto_gives_gguf_weights_a_bf16_kv_cache(
    tiny_model_factory, tmp_path, caplog, monkeypatch, auto_bf16
):
    """GGUF weights stay quantized (float32 activations) and, on a CPU with native bf16,
    the KV cache holds bf16: twice the blocks in the same memory, said in the one line.
    `--kv-cache-dtype float32`, `--dtype float32`, the torch attention backend, a CPU
    without native bf16 and FLEETSERVE_AUTO_BF16=0 each keep float32."""
    from fleetserve.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler here: GGUF weights are dequantized")
    gguf = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_factory("llama"), gguf)
    monkeypatch.setattr("fleetserve.engine.arg_utils.cpu_flags", lambda: ZEN4)
    caplog.set_level(logging.INFO, logger="fleetserve.engine.dtype_choice")
    kw = dict(model=gguf, max_model_len=64, kv_cache_memory=1 << 20)
    config, lines = _resolve_lines(caplog, monkeypatch, **kw)
    assert config.quantization == "gguf" and not config.bf16_weights
    assert config.model.dtype == torch.float32 and config.kv_dtype == torch.bfloat16
    assert len(lines) == 1 and lines[0].startswith("dtype auto -> float32 with a bf16 KV cache (")
    assert "gguf weights keep their quantized path" in lines[0]
    assert "--kv-cache-dtype float32 forces float32" in lines[0]
    forced, lines = _resolve_lines(caplog, monkeypatch, kv_cache_dtype="float32", **kw)
    assert forced.kv_dtype == torch.float32
    assert lines[0].startswith("dtype auto -> float32 (") and "all the same" not in lines[0]
    blocks = [c.cache.resolve_num_blocks(c.model, 1, c.kv_dtype) for c in (config, forced)]
    assert blocks[0] == 2 * blocks[1]
    config, lines = _resolve_lines(caplog, monkeypatch, dtype="float32", **kw)
    assert config.kv_dtype == torch.float32 and lines == []
    config, lines = _resolve_lines(caplog, monkeypatch, attention_backend="torch", **kw)
    assert config.kv_dtype == torch.float32 and "all the same" not in lines[0]
    monkeypatch.setenv(dtype_choice.AUTO_BF16_ENV, "0")
    config, lines = _resolve_lines(caplog, monkeypatch, **kw)
    assert config.kv_dtype == torch.float32 and f"{dtype_choice.AUTO_BF16_ENV}=0" in lines[0]
    monkeypatch.delenv(dtype_choice.AUTO_BF16_ENV)
    monkeypatch.setattr("fleetserve.engine.arg_utils.cpu_flags", lambda: ICE_LAKE)
    config, lines = _resolve_lines(caplog, monkeypatch, **kw)
    assert config.kv_dtype == torch.float32 and "(AVX-512) has no native" in lines[0]
