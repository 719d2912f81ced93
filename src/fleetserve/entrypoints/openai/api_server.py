"""`fleetserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) of a fleet;
this module launches it (flags: server_args.py; the app: app_factory.py; uvicorn
that drains: draining_server.py).

`--config fleet.yaml` names the models (serve/config/fleet_config.py); without it the flags
describe a fleet of one generate model. Lifecycle:
1. The fleet file is validated and every model's config and tokenizer load here; a bad
   file or --model fails before binding a port.
2. uvicorn binds; /live answers at once, /health and /ready are 503 while the engine
   processes load the weights. Once every model is ready, a curl line is printed.
3. SIGTERM/SIGINT drains: /health and /ready turn 503, new requests get 503, in-flight
   ones finish up to --drain-timeout (then they are aborted), the engine processes are
   shut down and the server exits 0. A second signal skips the wait.
4. If a model's last engine process dies, /health returns 503 and its requests get a
   503; the server keeps answering so an orchestrator can see it and replace it.
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from fleetserve.batch.store import BatchStore, default_state_dir
from fleetserve.entrypoints.openai.access_log import configure_access_log
from fleetserve.entrypoints.openai.app_factory import ServerState, build_app
from fleetserve.entrypoints.openai.draining_server import DrainingServer
from fleetserve.entrypoints.openai.http_protocol import FrontDoorH11Protocol
from fleetserve.entrypoints.openai.server_args import add_cli_args, api_key_from, fleet_from_args
from fleetserve.entrypoints.openai.serving_common import ServingContext
from fleetserve.metrics import ServerMetrics
from fleetserve.serve.services.service_registry import build_registry
from fleetserve.serve.telemetry.fleet_metrics import FleetCollector

__all__ = ["add_cli_args", "run"]  # add_cli_args + run: cli.py's contract


def run(args: argparse.Namespace) -> int:
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not args.request_read_timeout > 0:
        raise ValueError(f"--request-read-timeout must be > 0, got {args.request_read_timeout}")
    api_key = api_key_from(args.api_key, os.environ)
    fleet = fleet_from_args(args)
    if args.ray:
        from fleetserve.ray.serve_cli import run_on_ray

        return run_on_ray(args, fleet, api_key)
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --ray")
    ray_only = fleet.ray_only_keys()
    if ray_only:
        raise ValueError(f"{', '.join(ray_only)}: only `fleetserve serve --ray` honours these")
    metrics = ServerMetrics()
    registry = build_registry(fleet, metrics)
    metrics.registry.register(FleetCollector(list(registry)))
    ctx = ServingContext(registry, args.max_request_bytes, args.request_read_timeout)
    state = ServerState(ctx, metrics, api_key)
    if args.batch_concurrency < 1:
        raise ValueError(f"--batch-concurrency must be >= 1, got {args.batch_concurrency}")
    store = BatchStore(args.state_dir or default_state_dir())
    app = build_app(state, args.drain_timeout, args.allowed_origins, store, args.batch_concurrency)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=FrontDoorH11Protocol.with_header_timeout(args.request_read_timeout),
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
        access_log=args.log_level == "debug",
    )
    configure_access_log(args.access_log)
    server = DrainingServer(config, state)
    state.server = server
    server.run()
    if registry.crashed and state.exit_code == 0:
        state.exit_code = 1  # the engine process crashed or was killed
    return state.exit_code
