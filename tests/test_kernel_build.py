"""The CPU kernel library must not change the process's floating-point state."""

from __future__ import annotations

import pytest

from fleetserve.kernels import cpu as cpu_kernels

SMALLEST_NORMAL = 2.2250738585072014e-308


def test_loading_the_kernels_keeps_subnormals() -> None:
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the kernels are not built here")
    # With flush-to-zero (what -ffast-math's crtfastmath.o turns on at load) this is 0.0.
    half = SMALLEST_NORMAL / 2
    assert half > 0.0
    assert half * 2 == SMALLEST_NORMAL
