"""Per-request timings of a serving benchmark and their summary.

Definitions (the ones vLLM's benchmark uses, so figures compare):
- TTFT: request sent -> first chunk that carries output text.
- ITL: gaps between consecutive text-carrying chunks (one chunk may hold several tokens).
- TPOT: (e2e - TTFT) / (num_output_tokens - 1), per request with more than one token.
- e2e: request sent -> the stream's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome; timings in seconds. `error` is None when it succeeded."""

    num_prompt_tokens: int
    num_output_tokens: int
    expected_output_tokens: int | None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""  # the output text, all chunks joined
    finish_reason: str | None = None
    stream_id: str | None = None  # the `id` its chunks carried (the server's request id)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict[str, float]:
    out = {"mean": sum(values) / len(values) if values else float("nan")}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """Throughput and latency figures over the successful requests; seconds throughout."""
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if r.error is not None]
    num_out = sum(r.num_output_tokens for r in ok)
    num_in = sum(r.num_prompt_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(errors),
        "errors": sorted(set(errors))[:5],
        "num_output_mismatch": sum(
            r.expected_output_tokens is not None and r.num_output_tokens != r.expected_output_tokens
            for r in ok
        ),
        "duration_s": duration_s,
        "total_prompt_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": num_out / duration_s if duration_s > 0 else 0.0,
        "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_s": _stats([g for r in ok for g in r.itl_s]),
        "e2e_s": _stats([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


# fleetserve's engine counters on /metrics (metrics.py), summed over the server's models.
ENGINE_COUNTERS = ("num_steps", "step_seconds", "num_step_tokens")


def parse_engine_counters(text: str) -> dict[str, float] | None:
    """The engine counters in a /metrics page, each summed over its series; None where
    the page has none (a server other than fleetserve's)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = name.removeprefix("fleetserve:").removesuffix("_total")
        if name.startswith("fleetserve:") and key in ENGINE_COUNTERS:
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out if set(out) == set(ENGINE_COUNTERS) else None


def engine_busy(
    before: dict[str, float] | None, after: dict[str, float] | None, duration_s: float
) -> dict[str, float] | None:
    """What the engine did during a run (the counters' growth): steps, wall seconds in
    them against the run's duration, tokens per step. None without both scrapes."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
    steps = d["num_steps"]
    return {
        "num_steps": steps,
        "step_seconds": d["step_seconds"],
        "busy_fraction": d["step_seconds"] / duration_s if duration_s > 0 else 0.0,
        "ms_per_step": 1e3 * d["step_seconds"] / steps if steps else 0.0,
        "tokens_per_step": d["num_step_tokens"] / steps if steps else 0.0,
    }


def format_summary(s: dict[str, Any], title: str) -> str:
    lines = [
        f"==== {title} ====",
        f"requests: {s['num_completed']}/{s['num_requests']} completed, "
        f"{s['num_errors']} errors, {s['num_output_mismatch']} with an unexpected token count",
        f"duration: {s['duration_s']:.2f} s; prompt tokens {s['total_prompt_tokens']}, "
        f"output tokens {s['total_output_tokens']}",
        f"request throughput: {s['request_throughput']:.3f} req/s; "
        f"output throughput: {s['output_throughput']:.1f} tok/s",
        f"{'ms':>6} {'mean':>9}" + "".join(f" {f'p{q}':>9}" for q in PERCENTILES),
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        st = s[key]
        cells = [st["mean"]] + [st[f"p{q}"] for q in PERCENTILES]
        lines.append(f"{label:>6}" + "".join(f" {1e3 * v:9.1f}" for v in cells))
    busy = s.get("engine")
    if busy is not None:
        lines.append(
            f"engine: {busy['num_steps']:.0f} steps, busy {busy['step_seconds']:.2f} s of the "
            f"{s['duration_s']:.2f} s ({100 * busy['busy_fraction']:.1f}%), "
            f"{busy['ms_per_step']:.1f} ms and {busy['tokens_per_step']:.1f} tokens a step"
        )
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def max_rate_under_slo(runs: list[dict[str, Any]], ttft_slo_s: float) -> float | None:
    good = [
        r["request_rate"]
        for r in runs
        if r["request_rate"] is not None
        and r["num_errors"] == 0
        and r["ttft_s"]["p99"] < ttft_slo_s
    ]
    return max(good) if good else None


def plot_sweeps(reports: list[dict[str, Any]], path: str) -> None:
    """p50 (dashed) and p99 (solid) TTFT and e2e latency against request rate, per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key, title in (
        (axes[0], "ttft_s", "time to first token"),
        (axes[1], "e2e_s", "end-to-end latency"),
    ):
        for i, rep in enumerate(reports):
            runs = sorted(
                (r for r in rep["runs"] if r["request_rate"]), key=lambda r: r["request_rate"]
            )
            xs = [r["request_rate"] for r in runs]
            color = f"C{i}"
            ax.plot(
                xs, [r[key]["p99"] for r in runs], "o-", color=color, label=f"{rep['label']} p99"
            )
            ax.plot(
                xs, [r[key]["p50"] for r in runs], "s--", color=color, label=f"{rep['label']} p50"
            )
        rates = [r["request_rate"] for rep in reports for r in rep["runs"] if r["request_rate"]]
        if rates and max(rates) >= 10 * min(rates):
            ax.set_xscale("log")  # servers whose capacities differ by 10x or more
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("seconds")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=80)
    plt.close(fig)
