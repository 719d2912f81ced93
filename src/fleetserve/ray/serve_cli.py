"""`fleetserve serve --ray`: the fleet as a Ray Serve application, until Ctrl-C / SIGTERM.

Joins the cluster at --ray-address (`auto`: the one this machine belongs to), or starts a
local Ray. Serve's HTTP proxy listens on --host/--port. On the signal, in order and within
--drain-timeout (plus a few seconds for the cluster itself): the application is deleted
(Serve drains its replicas; past the drain timeout the rest is cut short), then a Ray
started here is shut down (its processes with it: no Serve shutdown first, nothing left to
talk to a cluster that is going away); a joined cluster is left running. Exit code 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
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
        # "local": a Ray of its own, as documented, even where another Ray runs on this
        # machine (a bare ray.init() would join that one).
        ray.init(address="local", include_dashboard=False,
                 log_to_driver=args.log_level == "debug")  # fmt: skip
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
        _delete_app(args.drain_timeout)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if started_here:
            started = time.monotonic()
            ray.shutdown()
            print(f"fleetserve: Ray stopped in {time.monotonic() - started:.1f} s", flush=True)
    # Everything is stopped; the interpreter's teardown of Ray's and torch's modules took
    # another ~10 s on a loaded machine, past the drain timeout. Skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _delete_app(drain_timeout_s: float) -> None:
    """Delete the application and wait (at most the drain timeout) until Serve has
    drained and removed it."""
    from ray import serve

    print("fleetserve: shutting down the Ray Serve application", flush=True)
    started = time.monotonic()
    serve.delete(APP_NAME, _blocking=False)
    while time.monotonic() - started < drain_timeout_s:
        if APP_NAME not in serve.status().applications:
            print(f"fleetserve: application deleted in {time.monotonic() - started:.1f} s",
                  flush=True)  # fmt: skip
            return
        time.sleep(0.2)
    print(f"fleetserve: the application was not gone after the drain timeout "
          f"({drain_timeout_s:g} s); stopping anyway", flush=True)  # fmt: skip
