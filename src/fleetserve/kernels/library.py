"""Build and load the C kernel library for the CPU (kernels/cpu.py's module docstring: the
cache, FLEETSERVE_CPU_KERNELS, the plain-torch fallback). Imports no torch: the API
process asks whether the library builds here (`--dtype auto`'s bf16 check) without it;
the tensor wrappers are in cpu.py and the other kernel modules.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "read_probe.c",  # bench roofline's read probe
        "paged_attention.c", "fused_ops.c", "gemm.c", "quant_gemm.c", "quant_panel.c",
        "quant_dot.c", "quant_dot_simd.c", "quant_dot_amx.c", "quant_avx2.c", "decode_step.c",
        "moe.c", "lora.c", "gemm_bf16.c", "attention_amx.c", "gemm_bf16_tiled.c",
        "lead_share.c",
    )
]  # fmt: skip
# Included by the sources: part of the cache key, not compiled on their own.
_HEADERS = [
    Path(__file__).with_name(n)
    for n in (
        "gemm_tile.h", "quant_common.h", "quant_dot.h", "fused_rows.h", "amx_perm.h",
        "paged_decode.h", "paged_decode_bf16.h", "paged_verify.h", "bf16_bits.h", "amx_tiles.h",
        "bf16_block.h", "attention_bf16.h", "exp2_poly.h",
        "thread_buffer.h", "lead_share.h",
    )
]  # fmt: skip
# FLEETSERVE_CPU_MARCH picks another target than this CPU's own, e.g. x86-64-v3 (AVX2)
# or x86-64 (SSE2 only) to test the narrower code paths here.
_FLAGS = [
    "-O3",
    f"-march={os.environ.get('FLEETSERVE_CPU_MARCH', 'native')}",
    "-ffast-math",
    "-fopenmp",
    "-fPIC",
    "-std=c11",
]
# Linked without -ffast-math on purpose: with it, gcc adds crtfastmath.o, whose constructor
# turns on flush-to-zero for the whole process that loads the library (torch, numpy and
# Python's own floats would then lose subnormals).
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("FLEETSERVE_CACHE", os.path.expanduser("~/.cache/fleetserve"))
    return Path(root) / "kernels"


def _build(cc: str) -> Path:
    src = b"".join(f.read_bytes() for f in [*_SOURCES, *_HEADERS])
    key = hashlib.sha256(
        src + " ".join([cc, *_FLAGS, *_LINK_FLAGS, platform.machine(), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first starts never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
            objs = [str(Path(objdir) / f"{f.stem}.o") for f in _SOURCES]
            for source, obj in zip(_SOURCES, objs, strict=True):
                _run([cc, *_FLAGS, "-c", str(source), "-o", obj])
            _run([cc, *_LINK_FLAGS, *objs, "-o", tmp, "-lm"])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@cache
def open_library() -> ctypes.CDLL | None:
    """The kernel library, built on first use and opened (no function signatures set:
    kernels/cpu.py's `load()` sets them), or None when it cannot be used here."""
    if os.environ.get("FLEETSERVE_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: attention runs on the plain-torch path")
        return None
    try:
        return ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("CPU kernels unavailable (%s): using the plain-torch path", detail.strip())
        return None


def bf16_native() -> bool:
    """Whether the library was built with AVX512-BF16 (`vdpbf16ps`); False without it."""
    lib = open_library()
    if lib is None:
        return False
    lib.bf16_native.argtypes = []
    lib.bf16_native.restype = ctypes.c_int
    return bool(lib.bf16_native())


def int8_dot_kernel() -> str | None:
    """The SIMD integer-dot kernel the library was built with for this CPU ("AVX-512
    VNNI" or "AVX2"), or None (plain C, or no C kernels)."""
    lib = open_library()
    if lib is None:
        return None
    lib.quant_dot_kind.argtypes = []
    lib.quant_dot_kind.restype = ctypes.c_int
    return {2: "AVX-512 VNNI", 1: "AVX2"}.get(int(lib.quant_dot_kind()))
