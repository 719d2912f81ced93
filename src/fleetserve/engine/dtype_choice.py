"""`--dtype auto` (the default): the compute dtype this CPU runs fastest for a checkpoint,
and why, said once at start-up.

Today that is float32 everywhere: fleetserve's C kernels (the GEMMs, the fused decode step,
paged attention; kernels/) compute in float32, and the quantized GGUF / int8 paths
dequantize into float32 registers. A bfloat16 or float16 model runs the torch module path
instead. On a CPU without native bf16 that path is emulated (matmuls 7-400x slower than
float32, shared/bench/PEERS.md); on a CPU with AVX512-BF16 / AMX-BF16 it uses oneDNN but
loses the C step, and was measured slower too (bench workload, 48 requests: 16.4 s in
bfloat16 against 11.9 s in float32; issue 25). When a native bf16 C path lands, the
choice for those CPUs changes here, in one place, and the test of this chooser with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# /proc/cpuinfo names of the native 16-bit float instructions a future path would use.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
FP16_FLAGS = ("amx_fp16", "avx512_fp16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" | "bfloat16" | "float16"
    reason: str


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


def choose_dtype(checkpoint_dtype: str | None, flags: frozenset[str], device: str) -> DtypeChoice:
    """The fastest compute dtype for a checkpoint stored in `checkpoint_dtype` (its
    config's torch_dtype, None if unsaid) on a `device` with CPU feature `flags`."""
    stored = f"{checkpoint_dtype} checkpoint" if checkpoint_dtype else "checkpoint"
    if device != "cpu":
        return DtypeChoice("float32", f"{stored} on {device}: no faster kernels there")
    native = [f for f in (*BF16_FLAGS, *FP16_FLAGS) if f in flags]
    if native:
        why = (
            f"this CPU has {'/'.join(native)}, but fleetserve's C kernels (GEMMs, fused "
            "decode step, quantized paths) compute in float32 and a 16-bit model takes "
            "the slower torch module path"
        )
    else:
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        why = f"this CPU ({isa}) has no native bf16/fp16 compute: 16-bit matmuls are emulated"
    return DtypeChoice("float32", f"{stored}: {why}")


_announced: set[DtypeChoice] = set()


def announce(choice: DtypeChoice) -> None:
    """One INFO line per process and choice, shown even where logging is unconfigured."""
    if choice in _announced:
        return
    _announced.add(choice)
    if not logging.getLogger().hasHandlers() and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("fleetserve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.info("dtype auto -> %s (%s)", choice.dtype, choice.reason)
