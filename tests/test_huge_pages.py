"""kernels/huge_pages.py: tensors carved from huge-page chunks are separate, aligned and
keep their contents; large ones start on a 2 MiB boundary."""

from __future__ import annotations

import pytest
import torch

from fleetserve.kernels import huge_pages

pytestmark = pytest.mark.skipif(huge_pages._madvise() is None, reason="no madvise here")


def test_small_tensors_share_a_chunk_without_overlap() -> None:
    shapes = [(300, 512), (1000, 97), (64, 1024), (513, 129)]
    ts = [huge_pages.empty_huge(*s, dtype=torch.uint8) for s in shapes]
    ts += [huge_pages.empty_huge(200, 300), huge_pages.empty_huge(70, 1024, dtype=torch.bfloat16)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(t.data_ptr() % 64 == 0 and t.is_contiguous() for t in ts)
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    for i, t in enumerate(ts):  # nothing wrote over another tensor
        assert bool((t == i + 1).all())
    assert [tuple(t.shape) for t in ts[:4]] == shapes
    assert ts[4].dtype == torch.float32 and ts[5].dtype == torch.bfloat16


def test_large_tensor_starts_on_a_huge_page() -> None:
    t = huge_pages.empty_huge(40 << 20, dtype=torch.uint8)
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and t.numel() == 40 << 20
    t[-1] = 7
    assert int(t[-1]) == 7


def test_tiny_tensor_is_plain() -> None:
    t = huge_pages.empty_huge(3, 5)
    assert t.shape == (3, 5) and t.dtype == torch.float32


def test_switch_off_gives_plain_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETSERVE_HUGE_PAGES", "0")
    t = huge_pages.empty_huge(1024, 1024)  # 4 MiB: would come from a chunk
    assert t._base is None and t.shape == (1024, 1024)
    monkeypatch.setenv("FLEETSERVE_HUGE_PAGES", "1")
    assert huge_pages.empty_huge(1024, 1024)._base is not None
