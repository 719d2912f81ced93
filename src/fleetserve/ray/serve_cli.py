"""`fleetserve serve --ray`: the fleet as a Ray Serve application, until Ctrl-C / SIGTERM.

Joins the cluster at --ray-address (`auto`: the one this machine belongs to), or starts a
local Ray. Serve's HTTP proxy listens on --host/--port. On the signal the application is
deleted (Serve drains its replicas) and a Ray started here is shut down; exit code 0.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from fleetserve.serve.config.fleet_config import FleetConfig

APP_NAME = "fleetserve"


def run_on_ray(args: argparse.Namespace, fleet: FleetConfig, api_key: str | None) -> int:
    import ray
    from ray import serve

    from fleetserve.ray.app import build_app
    from fleetserve.ray.ingress import IngressOptions

    options = IngressOptions(
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        request_read_timeout_s=args.request_read_timeout,
        drain_timeout_s=args.drain_timeout,
        allowed_origins=tuple(args.allowed_origins),
        access_log=args.access_log,
    )
    app = build_app(fleet, options)  # a bad model fails here, before Ray starts
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    started_here = args.ray_address is None
    if started_here:
        ray.init(include_dashboard=False, log_to_driver=args.log_level == "debug")
    else:
        ray.init(address=args.ray_address, log_to_driver=args.log_level == "debug")
    # After ray.init, which installs a SIGTERM handler of its own that aborts the process.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        names = ", ".join(m.name for m in fleet.models)
        print(
            f"fleetserve: ready on http://{host}:{args.port} via Ray Serve ({names})",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        print("fleetserve: shutting down the Ray Serve application", flush=True)
        serve.delete(APP_NAME)
        if started_here:
            serve.shutdown()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if started_here:
            ray.shutdown()
    return 0
