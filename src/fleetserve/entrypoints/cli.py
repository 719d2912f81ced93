"""`fleetserve` command line: serve | generate | batch | bench | make-model.

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
    "batch": ("fleetserve.bench.batch", "`batch run` against the offline LLM.generate ceiling"),
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
    bench = sub.add_parser("bench", help="benchmarks (offline | serve | batch)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    chosen_bench = argv[1] if chosen == "bench" and len(argv) > 1 else None
    for name, (module, help_) in _BENCH.items():
        if chosen_bench == name:
            _add(bench_sub, name, module, help_)
        else:
            bench_sub.add_parser(name, help=help_)
    return parser


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
