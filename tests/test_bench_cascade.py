"""`fleetserve bench cascade`'s arithmetic: the shipped prompt set, the threshold sweep
(what a greedy `min_mean_logprob` cascade answers) and the table (no server, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.bench.cascade_sweep import (
    Prompt,
    TierAnswer,
    cascade_pick,
    format_table,
    is_correct,
    load_prompts,
    sweep,
)
from fleetserve.entrypoints.cli import build_parser


def test_the_shipped_set_is_mixed_and_well_formed() -> None:
    prompts = load_prompts()
    assert 40 <= len(prompts) <= 60
    kinds = [p.kind for p in prompts]
    assert kinds.count("easy") >= 10 and kinds.count("hard") >= 10
    assert kinds[:2] == ["easy", "hard"]  # interleaved: --limit N keeps the mix


def test_a_bad_prompt_file_names_the_field(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "2 + 2 =", "answer": "4"}) + "\n" + json.dumps({"prompt": "x"})
    )
    with pytest.raises(ValueError, match=r"prompts\[1\]\.answer"):
        load_prompts(f)


def test_correct_reads_the_first_line_only() -> None:
    assert is_correct(" Paris.\nThe capital", "paris")
    assert not is_correct(" a city\nParis", "Paris")
    assert not is_correct("", "4")


def test_the_rule_escalates_below_the_floor_only() -> None:
    a = TierAnswer("x", -1.0, 3, 1.0)
    assert cascade_pick(a, -1.0) and cascade_pick(a, -2.0) and not cascade_pick(a, -0.5)


P = [Prompt("2 + 2 =", "4", "easy"), Prompt("17 + 26 =", "43", "hard")]
SMALL = [TierAnswer(" 4", -0.2, 2, 10.0), TierAnswer(" 42", -2.0, 4, 20.0)]
LARGE = [TierAnswer(" 4", -0.1, 2, 30.0), TierAnswer(" 43", -0.5, 4, 40.0)]


def test_the_sweep_against_hand_worked_rows() -> None:
    rows = sweep(P, SMALL, LARGE, 1.0, 2.0, thresholds=(float("-inf"), -1.0, float("inf")))
    keep_all, mixed, escalate_all = rows
    # always small: both answers the small tier's; compute 6 x 1 against 6 x 2
    assert keep_all.small_share == 1.0 and keep_all.mean_latency_ms == 15.0
    assert keep_all.compute_vs_large == 0.5
    assert keep_all.agreement == 0.5 and keep_all.accuracy == 0.5
    # -1.0: the first kept (-0.2), the second escalated (-2.0): small + large time and compute
    assert mixed.small_share == 0.5 and mixed.mean_latency_ms == (10.0 + 20.0 + 40.0) / 2
    assert mixed.compute_vs_large == (2 + 4 + 4 * 2) / 12
    assert mixed.agreement == 1.0 and mixed.accuracy == 1.0
    # always escalate: large's answers, paid on top of small's
    assert escalate_all.small_share == 0.0 and escalate_all.agreement == 1.0
    assert escalate_all.compute_vs_large == (6 + 12) / 12
    assert "| -1 | 50% |" in format_table(rows)


def test_the_sweep_refuses_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="one length"):
        sweep(P, SMALL[:1], LARGE, 1.0, 2.0)


def test_the_cli_knows_the_subcommand() -> None:
    argv = ["bench", "cascade", "--small", "a", "--large", "b", "--limit", "4"]
    args = build_parser(argv).parse_args(argv)
    assert args.small == "a" and args.limit == 4 and args.max_tokens == 8
