"""`fleetserve` command line: serve | generate | chat | bench | make-model | deploy.

Each subcommand lives in its own module exposing ``add_cli_args(parser)`` and
``run(args) -> int``; they are imported only when chosen, so `fleetserve --help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, help)
_COMMANDS = {
    "serve": ("fleetserve.entrypoints.openai.api_server", "run the OpenAI-compatible server"),
    "generate": ("fleetserve.entrypoints.generate", "generate a completion offline"),
    "make-model": ("fleetserve.models.make_model", "write a random-weight HF checkpoint"),
    "batch": ("fleetserve.entrypoints.batch", "batch jobs (run: a JSONL file of OpenAI lines)"),
}
_BENCH = {
    "offline": ("fleetserve.bench.offline", "offline throughput benchmark"),
    "serve": ("fleetserve.bench.serve", "serving benchmark against an OpenAI-compatible URL"),
    "sla": ("fleetserve.bench.sla", "interactive TTFT during a batch flood, with/without classes"),
    "embed": ("fleetserve.bench.embed", "embedding throughput, batched vs one at a time"),
    "spec": ("fleetserve.bench.spec", "one stream's decode speed with and without speculation"),
    "latency": ("fleetserve.bench.latency", "one stream: TTFT and decode tok/s (vs llama.cpp)"),
    "roofline": ("fleetserve.bench.roofline", "read bandwidth of 1 and 2 cores: one stream's roof"),
    "perplexity": ("fleetserve.bench.perplexity", "perplexity of each weight quantization"),
    "batch": ("fleetserve.bench.batch", "`batch run` against the offline LLM.generate ceiling"),
    "chaos": ("fleetserve.bench.chaos", "replicas killed under streaming load: lost, latency"),
    "kernels": ("fleetserve.bench.quant_kernels", "quantized GEMM GFLOP/s, float vs int8 x"),
    "moe": (
        "fleetserve.bench.moe",
        "one MoE layer's step against the dense MLP of equal active size",
    ),
    "stream-cpu": ("fleetserve.bench.stream_cpu", "the server's CPU per streamed token vs length"),
    "kv-window": ("fleetserve.bench.kv_window", "one long conversation's K/V, window freed or not"),
    "lora": ("fleetserve.bench.lora", "16 streams over 8 LoRA adapters vs base; cold-adapter TTFT"),
    "rag": (
        "fleetserve.bench.rag",
        "embed -> generate as a custom handler via the fleet client vs by hand: overhead/hop",
    ),
    "cascade": (
        "fleetserve.bench.cascade_sweep",
        "a two-tier cascade's threshold table: small share, latency, compute, agreement",
    ),
    "structured": (
        "fleetserve.bench.structured",
        "JSON-schema requests vs free ones: step cost, or served against vLLM / llama.cpp",
    ),
}
_DEPLOY = {
    "k8s": ("fleetserve.deploy.k8s", "render Kubernetes + KEDA manifests from a fleet file"),
    "grafana": ("fleetserve.deploy.grafana", "write the fleet's Grafana dashboard JSON"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    mod = importlib.import_module(module)
    mod.add_cli_args(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (module, help_) in _COMMANDS.items():
        if chosen == name:
            _add(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    _add_group(
        sub,
        "bench",
        "benchmarks (offline | serve | sla | embed | spec | latency | perplexity | batch | chaos "
        "| kernels | moe | stream-cpu | kv-window | lora | structured | cascade | rag | roofline)",
        _BENCH,
        argv,
    )
    _add_group(sub, "deploy", "deployment manifests (k8s | grafana)", _DEPLOY, argv)
    return parser


def _add_group(
    sub: argparse._SubParsersAction,
    group: str,
    help_: str,
    commands: dict[str, tuple[str, str]],
    argv: list[str],
) -> None:
    """`fleetserve GROUP NAME ...`: only the chosen NAME's module is imported."""
    parser = sub.add_parser(group, help=help_)
    group_sub = parser.add_subparsers(dest=f"{group}_command", metavar=group.upper())
    chosen = argv[1] if argv and argv[0] == group and len(argv) > 1 else None
    for name, (module, cmd_help) in commands.items():
        if chosen == name:
            _add(group_sub, name, module, cmd_help)
        else:
            group_sub.add_parser(name, help=cmd_help)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except ValueError as e:
        print(f"fleetserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
