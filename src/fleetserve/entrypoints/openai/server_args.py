"""`fleetserve serve`'s command line: its flags, the fleet they describe (the fleet file
with --config, else a fleet of one model), the served name and the API key.

Imports nothing of Ray or of the HTTP app: the launcher (api_server.py) and the Ray
application builder (ray/app.py) both read it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.entrypoints.engine_args_cli import add_engine_args, engine_args_from
from fleetserve.entrypoints.openai.access_log import ACCESS_LOG_MODES
from fleetserve.serve.config.fleet_config import FleetConfig, load_fleet_config, single_model_fleet
from fleetserve.serve.routing.policies import POLICY_NAMES


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--state-dir",
        default=None,
        help="where Batch API jobs and files live (SQLite + files; default: "
        "$FLEETSERVE_STATE_DIR, else ~/.local/state/fleetserve)",
    )
    g.add_argument(
        "--batch-concurrency",
        type=int,
        default=64,
        help="Batch API lines in flight at once (they queue in the `batch` class)",
    )
    g.add_argument(
        "--config",
        default=None,
        metavar="FLEET_YAML",
        help="serve the models of this fleet file (instead of --model and the engine flags)",
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name clients send")
    g.add_argument(
        "--tool-parser",
        default=None,
        choices=["hermes", "qwen", "llama3_json", "mistral", "json"],
        help="how tool calls are read from the model's output (default: by its chat template)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $FLEETSERVE_API_KEY)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests queued before the first token; beyond it, 503",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take after SIGTERM",
    )
    g.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024)
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=15.0,
        help="seconds a client may take to send a request's headers, and then its body",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        metavar="ORIGIN",
        help="web origins (https://app.example) whose pages may call the API (CORS); default: none",
    )
    g.add_argument("--log-level", default="info")
    g.add_argument(
        "--access-log",
        default="json",
        choices=ACCESS_LOG_MODES,
        help="one JSON line per request on stdout (logger fleetserve.access; request id, "
        "model, class, replicas, status, tokens, timings), whatever --log-level says; off: none",
    )
    ray = p.add_argument_group("ray (pip install fleetserve[ray])")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="run the fleet as a Ray Serve application (one deployment per model)",
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="auto|HOST:PORT",
        help="the Ray cluster to join (with --ray); default: start a local one",
    )
    dp = p.add_argument_group("data parallel")
    dp.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas (each its own engine process, TP x PP ranks) behind this API",
    )
    dp.add_argument(
        "--routing",
        default="least_loaded",
        choices=POLICY_NAMES,
        help="how requests are spread over the replicas (with --data-parallel-size > 1)",
    )
    res = p.add_argument_group("resilience (a fleet file's `resilience:` per model)")
    res.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times a request may move to another replica when its replica is lost "
        "(died, drained, hung); 0: never (it fails with a clear error)",
    )
    res.add_argument(
        "--no-replace-failed",
        dest="replace_failed",
        action="store_false",
        help="do not start a new replica when one dies or hangs",
    )
    res.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        help="seconds a replica may hold work without an engine step before it is "
        "declared hung (its requests move; it is killed and replaced)",
    )
    res.add_argument(
        "--sigterm-grace",
        type=float,
        default=15.0,
        help="seconds an engine process keeps serving after SIGTERM while its requests "
        "move to other replicas",
    )
    add_engine_args(p)


def default_served_name(model_path: str) -> str:
    name = os.path.basename(model_path.rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


# Flags that describe the one model of a flagless fleet; with --config the file does.
_MODEL_FLAGS = (
    "served_model_name", "max_waiting_requests", "data_parallel_size", "routing", "model",
    "dtype", "max_model_len", "block_size", "num_kv_blocks", "kv_cache_memory",
    "kv_cache_dtype", "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching",
    "scheduling_policy", "seed", "device", "num_threads", "attention_backend",
    "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel", "migration_limit",
    "replace_failed", "hang_timeout", "sigterm_grace", "tool_parser",
)  # fmt: skip


def fleet_from_args(args: argparse.Namespace) -> FleetConfig:
    """The fleet file, or the flags' fleet of one model. With --config a model flag is an
    error (it would be ignored)."""
    if args.config is not None:
        parser = argparse.ArgumentParser()
        add_cli_args(parser)
        defaults = vars(parser.parse_args([]))
        given = [f for f in _MODEL_FLAGS if getattr(args, f) != defaults[f]]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ValueError(f"--config describes every model; leave out {flags}")
        return load_fleet_config(args.config)
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    engine_args = engine_args_from(args)
    name = served_name(engine_args, args.served_model_name)
    resilience = {
        "migration_limit": args.migration_limit,
        "replace_failed": args.replace_failed,
        "hang_timeout_s": args.hang_timeout,
        "sigterm_grace_s": args.sigterm_grace,
    }
    return single_model_fleet(
        name,
        engine_args,
        args.data_parallel_size,
        args.routing,
        args.max_waiting_requests,
        resilience,
        tool_parser=args.tool_parser,
    )


def served_name(engine_args: EngineArgs, given: str | None) -> str:
    """The name clients send for a model given by flags: --served-model-name, else the
    checkpoint's file or folder name (the default model's when none is named)."""
    if given is not None:
        return given
    path = engine_args.model
    if path is None:
        from fleetserve.models.default_model import default_model_path

        try:
            path = default_model_path()
        except OSError as e:
            raise ValueError(str(e)) from e
    return default_served_name(path)


def api_key_from(flag: str | None, env: Mapping[str, str]) -> str | None:
    """The key from --api-key, else $FLEETSERVE_API_KEY, else None (no auth). An empty key
    or one with surrounding spaces is refused: the first would turn auth off without a
    word, the second could never match (clients strip the header value)."""
    source, key = ("--api-key", flag) if flag is not None else ("FLEETSERVE_API_KEY", None)
    if flag is None:
        key = env.get("FLEETSERVE_API_KEY")
    if key is None:
        return None
    if key == "":
        raise ValueError(f"{source} is empty; give a key, or leave it out to serve without auth")
    if key != key.strip():
        raise ValueError(f"{source} has leading or trailing whitespace, so it could never match")
    if not key.isprintable() or not key.isascii():
        raise ValueError(f"{source} must be printable ASCII (it travels in an HTTP header)")
    return key
