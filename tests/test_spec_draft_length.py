"""The adaptive draft length (spec_decode/draft_length.py): what it learns from each
verification and step, and the k it picks from that (no model)."""

from __future__ import annotations

import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.spec_decode.base import ProposalRequest
from fleetserve.spec_decode.config import SpeculativeConfig
from fleetserve.spec_decode.draft_length import PRIOR_RATE, DraftLengthChooser
from fleetserve.spec_decode.ngram import NgramProposer


def test_verification_outcomes_count_by_position() -> None:
    c = DraftLengthChooser(4)
    c.observe_verification([1, 2, 3], [1, 2, 9])  # two accepted, the third rejected
    assert c.reached[:4] == [1.0, 1.0, 1.0, 0.0]
    assert c.accepted[:4] == [1.0, 1.0, 0.0, 0.0]
    c = DraftLengthChooser(4)
    c.observe_verification([1, 2, 3], [1, 2, 3, 7])  # all accepted, then the bonus token
    assert c.accepted[:3] == c.reached[:3] == [1.0, 1.0, 1.0]
    c = DraftLengthChooser(4)
    c.observe_verification([1, 2, 3], [1, 2])  # cut short (a stop): no rejection seen
    assert c.reached[:3] == [1.0, 1.0, 0.0]
    c.observe_verification([5, 6], [7])  # the first draft rejected
    assert c.reached[0] == pytest.approx(0.98 + 1) and c.accepted[0] == pytest.approx(0.98)
    # Estimates start at the prior and follow the observations.
    fresh = DraftLengthChooser(2)
    assert fresh.acceptance(1) == pytest.approx(PRIOR_RATE)
    for _ in range(200):
        fresh.observe_verification([1, 2], [1, 3])
    assert fresh.acceptance(1) > 0.95 and fresh.acceptance(2) < 0.1
    assert fresh.expected_accepted(2) == pytest.approx(
        fresh.acceptance(1) * (1 + fresh.acceptance(2))
    )


def test_step_time_estimates() -> None:
    c = DraftLengthChooser(8)
    assert c.step_time(3) is None
    for t in (1.0, 1.1, 9.0):  # the median of the kept times: one outlier ignored
        c.observe_step(1, t)
    assert c.step_time(1) == 1.1
    # One count timed: past it, the least per-row cost (5% of the smallest step).
    assert c.step_time(3) == pytest.approx(1.1 + 2 * 0.05 * 1.1)
    c.observe_step(5, 2.3)
    assert c.step_time(5) == 2.3
    # Between timed counts: linear; fewer rows than any timed: the smallest.
    assert c.step_time(2) == pytest.approx(1.1 + 0.3)
    assert c.step_time(4) == pytest.approx(1.1 + 0.9)
    # Past the largest: the least-squares cost of a row (0.3 from two points).
    assert c.step_time(7) == pytest.approx(2.3 + 2 * 0.3)
    c.observe_step(9, 2.3)  # flat from 5 to 9: the fitted slope falls
    assert c.step_time(10) == pytest.approx(2.3 + _fit([1, 5, 9], [1.1, 2.3, 2.3]))
    c2 = DraftLengthChooser(8)
    c2.observe_step(5, 2.0)
    assert c2.step_time(2) == 2.0


def _fit(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def timed(chooser: DraftLengthChooser, cost: dict[int, float]) -> DraftLengthChooser:
    for rows, t in cost.items():
        for _ in range(3):
            chooser.observe_step(rows, t)
    return chooser


def test_choice_follows_acceptance_and_the_cost_of_rows() -> None:
    # One stream, rows cheap up to 8 then a jump (the decode kernels' limit here).
    cost = {r: 1.0 + 0.1 * (r - 1) for r in range(1, 9)}
    cost |= {r: 3.0 + 0.2 * (r - 9) for r in range(9, 18)}
    c = DraftLengthChooser(16)
    assert c.choose(1, 1.0, 1) == 16  # nothing timed: the configured number
    timed(c, cost)
    assert c.choose(1, 1.0, 0) == 0  # no multi-token match: nothing to choose
    for _ in range(100):
        c.observe_verification([1] * 16, [1] * 17)  # every draft accepted
    assert c.choose(1, 1.0, 1) == 7  # 8 rows: past them the step costs 3x
    for _ in range(6):
        assert c.choose(1, 1.0, 1) == 7
    assert c.choose(1, 1.0, 1) == 8  # every 8th choice: one more, to keep timing it
    assert c.choose(1, 1.0, 1) == 7
    for _ in range(300):
        c.observe_verification([1] * 16, [2])  # every first draft rejected
    assert c.choose(1, 1.0, 1) == 0
    # Rows that cost as much as a step each (a compute-bound batch): fewer drafts pay.
    c = timed(DraftLengthChooser(8), {r: float(r) for r in range(1, 40)})
    for _ in range(100):
        c.observe_verification([1] * 8, [1] * 4 + [2])  # four accepted, the fifth not
    assert c.choose(4, 4.0, 4) == 0
    cheap = timed(DraftLengthChooser(8), {r: 1.0 + 0.01 * r for r in range(1, 40)})
    for _ in range(100):
        cheap.observe_verification([1] * 8, [1] * 4 + [2])
    assert 4 <= cheap.choose(4, 4.0, 4) <= 8


def test_adaptive_proposer_learns_from_the_next_tokens() -> None:
    cfg = SpeculativeConfig("ngram", 6, prompt_lookup_max=3, draft_length="adaptive")
    prop = NgramProposer(cfg)
    assert prop.chooser is not None
    greedy = SamplingParams(temperature=0.0)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    first = prop.propose([ProposalRequest("a", seq, [], greedy)])[0].token_ids
    assert first == [3, 4, 5, 6, 7, 8]  # nothing timed yet: all six
    assert prop.pending["a"] == (len(seq), first)
    # The next step verified 3, 4 and rejected 5 (the target said 0).
    prop.note_step(7, True)
    prop.propose([ProposalRequest("a", seq + [3, 4, 0], [], greedy)])
    assert prop.chooser.reached[:4] == [1.0, 1.0, 1.0, 0.0]
    assert prop.chooser.accepted[:3] == [1.0, 1.0, 0.0]
    prop.note_step(1, True)
    assert list(prop.chooser.times) == [1]  # timed from the previous step's note
    prop.note_step(3, False)  # a step with a prefill: not timed
    assert list(prop.chooser.times) == [1]
    prop.forget("a")
    assert not prop.pending and not prop.indexes


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"num_speculative_tokens": 2, "draft_length": "auto"}, "draft_length"),
        ({"model": "/m", "num_speculative_tokens": 2, "draft_length": "adaptive"}, "ngram"),
    ],
)
def test_bad_draft_length_names_the_field(value: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)
    ok = SpeculativeConfig.parse({"num_speculative_tokens": 2, "draft_length": "adaptive"})
    assert ok is not None and ok.draft_length == "adaptive"
