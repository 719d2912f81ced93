"""`fleetserve bench spec` end to end on a tiny checkpoint: both engines run, the greedy
outputs are compared, the adaptive draft length is accepted by the command line, and
`--also` runs a second configuration in the same sitting."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fleetserve.bench import spec as bench_spec


def test_bench_spec_runs_each_workload_and_reports(tiny_llama: str, tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    bench_spec.add_cli_args(p)
    cfg = {"method": "ngram", "num_speculative_tokens": 6, "draft_length": "adaptive"}
    for workload in ("free", "edit"):
        out = tmp_path / f"{workload}.json"
        args = p.parse_args(
            ["--model", tiny_llama, "--workload", workload, "--repeats", "1", "--max-tokens",
             "12", "--max-model-len", "512", "--speculative-config", json.dumps(cfg),
             "--also", '{"num_speculative_tokens": 2}', "--json", str(out)]
        )  # fmt: skip
        assert bench_spec.run(args) == 0  # 0: the greedy outputs were identical
        result = json.loads(out.read_text())
        assert result["identical_outputs"] is True
        assert result["workload"] == workload and result["num_requests"] == 3
        assert result["speculative_config"]["draft_length"] == "adaptive"
        assert 0 <= result["drafts_per_verification"] <= 6
        # --also: a second configuration against the same baseline, in the same sitting.
        first, second = result["configs"]
        assert first["speculative_config"] == cfg and first["speedup"] == result["speedup"]
        assert second["speculative_config"] == {"num_speculative_tokens": 2}
        assert second["identical_outputs"] is True
        assert 0 <= second["drafts_per_verification"] <= 2
        assert set(result["decode_tok_s"]) == {"baseline", "speculative", "speculative 2"}
    # --batch: every workload's prompts at once (12 requests a pass).
    out = tmp_path / "batch.json"
    args = p.parse_args(
        ["--model", tiny_llama, "--batch", "--repeats", "1", "--max-tokens", "8",
         "--max-model-len", "512", "--speculative-config", json.dumps(cfg), "--json", str(out)]
    )  # fmt: skip
    assert bench_spec.run(args) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 3 * len(bench_spec.WORKLOADS) and result["identical_outputs"]
