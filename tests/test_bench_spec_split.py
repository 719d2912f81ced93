"""`python -m fleetserve.bench.spec_split` on a tiny checkpoint: the run's step figures add
up, and the captured verification and one-row steps replay with every phase timed."""

from __future__ import annotations

import pytest

from fleetserve.bench import spec_split
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import PHASES

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def test_spec_split_reports_steps_and_replays(tiny_llama: str) -> None:
    # k=1: every match proposes one draft, so 2-row verifications come up at once.
    out = spec_split.split(tiny_llama, threads=1, k=1, rounds=3, max_tokens=40)
    assert out["decode_steps"] > 0 and out["decoded_tokens"] >= out["decode_steps"]
    assert out["tokens_per_step"] == round(out["decoded_tokens"] / out["decode_steps"], 3)
    assert 0.0 <= out["acceptance_rate"] <= 1.0
    ms = out["ms_per_step"]
    assert ms["all"] > 0 and 0 < ms["c_step"] <= ms["all"]
    replay = out["replay"]
    assert set(replay["verify"]) == {*PHASES, "total"} == set(replay["one_row"])
    assert replay["verify"]["attention"] > 0 and replay["one_row"]["attention"] > 0
    assert replay["verify_in_one_row_steps"]["total"] > 0
    # one thread: no lead step, so no second thread's items or chunks
    assert out["lead_items"] == [0, 0] and out["lead_chunks"] == [0, 0]
    # each captured step's context (keys, its own rows included) past the prompt
    assert min(out["context"].values()) > 10


def test_spec_split_refuses_a_bad_k(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["spec_split", "--k", "0"])
    with pytest.raises(ValueError, match="--k must be in"):
        spec_split.main()
