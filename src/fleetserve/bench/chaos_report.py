"""The figures of `fleetserve bench chaos`: each phase's streams checked against the
undisturbed reference run of the same requests, and its latencies, overall and for the
requests that moved to another replica."""

from __future__ import annotations

import math
import re
from dataclasses import asdict
from typing import Any

from fleetserve.bench.chaos_faults import FaultRecord
from fleetserve.bench.serve_metrics import RequestResult, percentile

# What the fleet's service logs (logger fleetserve.serve, INFO) when it moves a request:
# "<model>: request <id>-<prompt index> moves off replica <n> (<why>)".
_MIGRATION_LOG = re.compile(r"request (\S+)-\d+ moves off replica \d+")


def migrated_ids(log_text: str) -> list[str]:
    """The request ids (as their stream chunks carry them) of each move in `log_text`, one
    entry per move."""
    return _MIGRATION_LOG.findall(log_text)


def _p(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


def _same(got: RequestResult, want: RequestResult) -> bool:
    usage = (got.num_prompt_tokens, got.num_output_tokens)
    return (
        got.text == want.text
        and usage == (want.num_prompt_tokens, want.num_output_tokens)
        and got.finish_reason == want.finish_reason
    )


def phase_summary(
    results: list[RequestResult],
    reference: list[RequestResult],
    reproducible: list[bool],
    moves: list[str],
    faults: list[FaultRecord],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """`reproducible[i]`: request i must equal its reference (greedy or seeded); `moves`:
    the ids of the requests moved, once per move (migrated_ids)."""
    moved = set(moves)
    lost = [r for r in results if not r.ok]
    compared = mismatched = mismatched_moved = 0
    for got, want, check in zip(results, reference, reproducible, strict=True):
        if not (check and got.ok and want.ok):
            continue
        compared += 1
        if not _same(got, want):
            mismatched += 1
            mismatched_moved += got.stream_id in moved
    ok = [r for r in results if r.ok]
    was_moved = [r for r in ok if r.stream_id in moved]
    stayed = [r for r in ok if r.stream_id not in moved]
    added: dict[bool, list[float]] = {True: [], False: []}  # by moved or not
    for got, want in zip(results, reference, strict=True):
        if got.ok and want.ok and got.e2e_s is not None and want.e2e_s is not None:
            added[got.stream_id in moved].append(got.e2e_s - want.e2e_s)
    return {
        "num_requests": len(results),
        "num_lost": len(lost),
        "errors": sorted({r.error or "" for r in lost})[:5],
        "num_compared": compared,
        "num_mismatched": mismatched,
        "num_mismatched_migrated": mismatched_moved,
        "num_migrations_logged": len(moves),
        "num_migrated_requests": len(was_moved),
        "ttft_s": _p([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e_s": _p([r.e2e_s for r in ok if r.e2e_s is not None]),
        "max_gap_s": _p([max(r.itl_s, default=0.0) for r in ok]),
        "migrated": {
            "ttft_s": _p([r.ttft_s for r in was_moved if r.ttft_s is not None]),
            "e2e_s": _p([r.e2e_s for r in was_moved if r.e2e_s is not None]),
            # Its end-to-end time less the same request's in the undisturbed run.
            "added_e2e_s": _p(added[True]),
            # The longest wait between two chunks: the stall its reader saw.
            "max_gap_s": _p([max(r.itl_s, default=0.0) for r in was_moved]),
        },
        "not_migrated": {
            "e2e_s": _p([r.e2e_s for r in stayed if r.e2e_s is not None]),
            # The slowdown of the rest (fewer replicas for a while, a busier machine).
            "added_e2e_s": _p(added[False]),
            "max_gap_s": _p([max(r.itl_s, default=0.0) for r in stayed]),
        },
        "faults": [asdict(f) for f in faults],
        **extra,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{1e3 * v:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_report(report: dict[str, Any]) -> str:
    head = (
        f"{'system':<11} {'phase':<9} {'reqs':>5} {'lost':>5} {'diff':>5} {'moved':>5} "
        f"{'TTFT p50':>9} {'p99':>6} {'E2E p50':>8} {'p99':>6} "
        f"{'moved E2E p50':>13} {'p99':>6} {'added p50':>9} {'p99':>6} {'stall p99':>9} "
        f"{'rest added p50':>14} {'p99':>6} {'stall p99':>9}"
    )
    lines = [
        "latency in ms; diff: streams unlike the reference run's (text or usage); moved: "
        "requests that changed replica; added: E2E less the same request's in the reference "
        "run; stall: the longest gap between two chunks of a stream; rest: the other requests",
        head,
    ]
    for run in report["runs"]:
        m, rest = run["migrated"], run["not_migrated"]
        lines.append(
            f"{run['system']:<11} {run['phase']:<9} {run['num_requests']:>5} "
            f"{run['num_lost']:>5} {run['num_mismatched']:>5} {run['num_migrated_requests']:>5} "
            f"{_ms(run['ttft_s']['p50']):>9} {_ms(run['ttft_s']['p99']):>6} "
            f"{_ms(run['e2e_s']['p50']):>8} {_ms(run['e2e_s']['p99']):>6} "
            f"{_ms(m['e2e_s']['p50']):>13} {_ms(m['e2e_s']['p99']):>6} "
            f"{_ms(m['added_e2e_s']['p50']):>9} {_ms(m['added_e2e_s']['p99']):>6} "
            f"{_ms(m['max_gap_s']['p99']):>9} "
            f"{_ms(rest['added_e2e_s']['p50']):>14} {_ms(rest['added_e2e_s']['p99']):>6} "
            f"{_ms(rest['max_gap_s']['p99']):>9}"
        )
    lines.append("")
    lines.append(
        f"{'system':<11} {'signal':<8} {'pid':>7} {'at s':>6} {'held':>5} {'gone s':>7} "
        f"{'unrouted s':>10} {'removed s':>9} {'new proc s':>10} {'new ready s':>11}"
    )
    for run in report["runs"]:
        for f in run["faults"]:
            held = "-" if f["num_requests"] is None else str(f["num_requests"])
            lines.append(
                f"{run['system']:<11} {f['signal']:<8} {f['pid']:>7} {f['at_s']:>6.1f} "
                f"{held:>5} {_s(f['gone_s']):>7} {_s(f['out_of_routing_s']):>10} "
                f"{_s(f['removed_s']):>9} "
                f"{_s(f['replacement_started_s']):>10} {_s(f['replacement_ready_s']):>11}"
            )
    for run in report["runs"]:
        for e in run["errors"]:
            lines.append(f"{run['system']} {run['phase']} error: {e}")
    return "\n".join(lines)
