"""`--dtype auto` (the default): the compute dtype this CPU runs fastest for a checkpoint,
and why, said once at start-up.

On a CPU with native bf16 (AVX512-BF16 `vdpbf16ps`, AMX-BF16 tiles) a float32 or bfloat16
checkpoint runs with bf16 weights (`EngineConfig.bf16_weights`): linear layers keep bf16
weights and round their inputs to bf16, with float32 sums (kernels/gemm_bf16.c at every
row count, in the C step too: AMX tiles where the CPU has them, else `vdpbf16ps`)
and the KV cache holds bf16 (`kv_cache_dtype` auto; attention widens it to float32 as it
reads); norms, attention's sums and the residual stream stay float32. Measured faster than
float32 end to end on the bench Llama, batched and one stream (docs/benchmarks.md, issue
25). GGUF and int8 weights keep their quantized paths (float32 activations), with a bf16
KV cache on such a CPU (`kv_cache_dtype` auto: a served decode step's attention reads
half the bytes; measured faster on a Zen 4 without AMX, docs/benchmarks.md, branch srv).
Everywhere else float32: fleetserve's C kernels compute in float32, and a float16
checkpoint is not narrowed to bf16's 8-bit mantissa. `--dtype float32` forces float32
(cache included), `--kv-cache-dtype float32` the cache alone; FLEETSERVE_AUTO_BF16=0 makes
auto keep float32 (A/B runs; the test suite's float32 references).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable
from dataclasses import dataclass, replace

from fleetserve.say_once import say_once

log = logging.getLogger(__name__)

# /proc/cpuinfo names of the native 16-bit float instructions.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
FP16_FLAGS = ("amx_fp16", "avx512_fp16")
AUTO_BF16_ENV = "FLEETSERVE_AUTO_BF16"
# What the start-up line adds where quantized weights get a bf16 KV cache.
BF16_KV_CACHE_WHY = (
    "the KV cache bf16 all the same (attention widens it to float32 as it reads: half the "
    "bytes a served decode step's attention reads); --kv-cache-dtype float32 forces float32"
)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" | "bfloat16" | "float16": the model's compute dtype
    reason: str
    # Linear layers keep bf16 weights on a float32 model (EngineConfig.bf16_weights).
    bf16_weights: bool = False
    # The KV cache holds bf16 beside float32 weights that stay quantized (GGUF, int8):
    # `kv_cache_dtype` auto (with bf16 weights the cache is bf16 anyway).
    bf16_kv_cache: bool = False

    def describe(self) -> str:
        if self.bf16_weights:
            return f"{self.dtype} with bf16 weights"
        return f"{self.dtype} with a bf16 KV cache" if self.bf16_kv_cache else self.dtype

    def without_bf16(self, why: str) -> DtypeChoice:
        """The same choice in plain float32, because of `why` (an engine setting that the
        bf16 weights cannot run with)."""
        if not self.bf16_weights:
            return self
        return replace(self, bf16_weights=False, reason=f"{self.reason}; but float32 here: {why}")

    def with_bf16_kv_cache(self, why: str) -> DtypeChoice:
        """The same choice with a bf16 KV cache beside quantized weights, because of `why`."""
        return replace(self, bf16_kv_cache=True, reason=f"{self.reason}; {why}")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def auto_bf16_allowed() -> bool:
    return os.environ.get(AUTO_BF16_ENV, "1") != "0"


def choose_dtype(checkpoint_dtype: str | None, flags: frozenset[str], device: str) -> DtypeChoice:
    """The fastest compute dtype for a checkpoint stored in `checkpoint_dtype` (its
    config's torch_dtype, None if unsaid) on a `device` with CPU feature `flags`."""
    stored = f"{checkpoint_dtype} checkpoint" if checkpoint_dtype else "checkpoint"
    if device != "cpu":
        return DtypeChoice("float32", f"{stored} on {device}: no faster kernels there")
    bf16 = [f for f in BF16_FLAGS if f in flags]
    if bf16:
        has = f"this CPU has {'/'.join(bf16)}"
        if checkpoint_dtype == "float16":
            why = f"{has}, but bf16 would drop 3 bits of a float16 weight's mantissa"
            return DtypeChoice("float32", f"{stored}: {why}")
        if not auto_bf16_allowed():
            return DtypeChoice("float32", f"{stored}: {has}, but {AUTO_BF16_ENV}=0")
        why = (
            f"{has}: linear layers in bf16 (AMX bf16 tiles where present, else bf16 dot "
            "products, float32 sums; a bf16 KV cache; norms and "
            "attention float32, attention's products bf16: AMX tiles where present for "
            "prefill, else bf16 dot products), "
            "measured faster than float32; --dtype float32 forces float32"
        )
        return DtypeChoice("float32", f"{stored}: {why}", bf16_weights=True)
    fp16 = [f for f in FP16_FLAGS if f in flags]
    if fp16:
        why = f"this CPU has {'/'.join(fp16)} but no bf16, and fleetserve computes in float32"
    else:
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        why = f"this CPU ({isa}) has no native bf16/fp16 compute: 16-bit matmuls are emulated"
    return DtypeChoice("float32", f"{stored}: {why}")


_announced: set[Hashable] = set()


def announce(choice: DtypeChoice) -> None:
    """One INFO line per process and choice, shown even where logging is unconfigured."""
    say_once(log, _announced, choice, f"dtype auto -> {choice.describe()} ({choice.reason})")
