"""Tensors on transparent huge pages (THP "madvise" mode): weights a decode step streams
through once per token, and the KV cache.

Why: on 4 KiB pages a stream takes a TLB miss every 4 KiB and the hardware prefetchers
stop at every 4 KiB boundary. A streaming read of 100 MB on this machine's cores ran at
~2x the rate on 2 MiB pages (bench/roofline.py's probe, 1 thread). madvise can only put
whole 2 MiB-aligned ranges on huge pages, so a tensor of its own gets them for its
aligned interior only, and one under 4 MiB (each layer's projections on a small model:
0.2-1.1 MB on SmolLM2-135M) none at all. `empty_huge` therefore carves such tensors out
of shared 2 MiB-aligned chunks advised whole (`_Arena`), and gives larger ones a
2 MiB-aligned allocation of their own.

FLEETSERVE_HUGE_PAGES=0 leaves `empty_huge` to plain ``torch.empty`` (A/B runs: the same
code on 4 KiB pages).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
from functools import cache
from typing import Any

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
# A chunk the arena carves small tensors from; tensors of more than half of it get one
# of their own (the tail a chunk leaves when the next tensor does not fit is never
# written, so never resident).
_CHUNK = 32 << 20
_ALIGN = 64


@cache
def _madvise() -> Any:
    if platform.system() != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge(t: torch.Tensor) -> None:
    """Advise the 2 MiB-aligned interior of `t`'s memory onto transparent huge pages
    (before it is first written: pages already faulted in stay as they are)."""
    madvise = _madvise()
    nbytes = t.numel() * t.element_size()
    if madvise is not None and nbytes >= HUGE_PAGE:
        addr = t.data_ptr()
        start = -(-addr // HUGE_PAGE) * HUGE_PAGE
        end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: errors are harmless


def _aligned_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of fresh memory starting on a 2 MiB boundary, advised onto huge pages."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    t = raw[skip : skip + nbytes]
    advise_huge(t)
    return t


class _Arena:
    """Bump allocation of small tensors out of 2 MiB-aligned chunks. A carved tensor is
    a view of its chunk and keeps it alive; the arena keeps only the chunk it carves
    from, so what it holds beyond the live tensors is at most that one chunk's carved
    part (a model loaded and dropped, then another: the second carves on from there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            start = -(-self._used // _ALIGN) * _ALIGN
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk, start = _aligned_bytes(_CHUNK), 0
            self._used = start + nbytes
            return self._chunk[start : start + nbytes]


_arena = _Arena()


def empty_huge(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.empty`` on the CPU backed by transparent huge pages where the kernel
    allows them: from the shared arena under half a chunk, else 2 MiB-aligned on its
    own. Must be called before the memory is first written."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    off = os.environ.get("FLEETSERVE_HUGE_PAGES", "1") == "0"
    if off or _madvise() is None or nbytes < 64 << 10:  # no THP, or too small to matter
        return torch.empty(*shape, dtype=dtype)
    raw = _arena.take(nbytes) if nbytes <= _CHUNK // 2 else _aligned_bytes(nbytes)
    return raw.view(dtype).view(*shape)


def zeroed_huge(*shape: int, dtype: torch.dtype, prefault: bool = True) -> torch.Tensor:
    """A zero tensor in fresh anonymous memory (zero by the OS's word, whatever its size),
    its 2 MiB-aligned interior advised onto huge pages. `prefault`: write it now, so that
    its page faults are paid here and not inside the first requests that touch it (the
    KV cache: 1.2 s for the bench's 1.15 GB); without it, pages nothing writes are never
    faulted in (a test's engine that serves a few short requests)."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    t = torch.frombuffer(buf, dtype=dtype, count=numel).view(*shape)
    advise_huge(t)
    if prefault:
        t.zero_()
    return t
