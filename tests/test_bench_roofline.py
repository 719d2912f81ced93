"""bench/roofline.py: the read probe and `bench latency --roofline` on a tiny model (speed
is not asserted, only that each figure is there and consistent)."""

from __future__ import annotations

import json

import pytest

from fleetserve.bench import latency, roofline
from fleetserve.entrypoints.cli import main
from fleetserve.kernels import library

pytestmark = pytest.mark.skipif(library.open_library() is None, reason="no C compiler here")


@pytest.mark.parametrize("huge", [True, False])
def test_probe_reads_the_buffer_it_was_given(huge: bool) -> None:
    p = roofline.read_bandwidth(4, 2, reps=3, huge=huge)
    assert p.threads == 2 and p.megabytes == pytest.approx(4, rel=0.01)
    assert p.best_gbs >= p.median_gbs > 0 and p.cpu_gbs > 0


def test_probe_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="megabytes"):
        roofline.read_bandwidth(0, 1)


def test_bench_roofline_command(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    args = ["bench", "roofline", "--set-mb", "4", "--dram-mb", "8", "--reps", "3"]
    assert main([*args, "--json", str(out)]) == 0
    probes = json.loads(out.read_text())
    assert [(p["size"], p["threads"]) for p in probes] == [
        ("set", 1), ("set", 2), ("dram", 1), ("dram", 2),
    ]  # fmt: skip
    assert "read probe dram" in capsys.readouterr().out


def test_latency_roofline_counts_the_bytes_a_token_reads(
    tiny_llama, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(latency, "default_dram_mb", lambda: 8.0)
    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--model", tiny_llama, "--num-tokens", "6", "--repeats", "1"]
    assert main([*args, "--quantization", "int8", "--roofline", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    fs = res["fleetserve"]
    # int8 weights: at least one byte per weight of every projection.
    assert fs["mb_per_token"] > 0
    assert {p["threads"] for p in res["read_probes"]} == {1, 2}
    assert "roofline:" in capsys.readouterr().out
