"""The routers of this process, by deployment name (the ingress reads replica counts and
load figures from them). Its own module, since Serve ships the router's module to the
process by value (cloudpickle): state kept there would be a copy nobody else sees, while
this module is imported by name, so the router and the ingress share one dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ROUTERS: dict[str, Any] = {}  # deployment name -> FleetRequestRouter
# deployment name -> called (on the router's thread) when its replica set changes
LISTENERS: dict[str, list[Callable[[], None]]] = {}


def replicas_changed(deployment_name: str) -> None:
    for listener in LISTENERS.get(deployment_name, []):
        listener()


def num_known_replicas(deployment_name: str) -> int | None:
    """Replicas the router of this process knows for the deployment; None before its
    first request (Serve makes a handle's router lazily)."""
    router = ROUTERS.get(deployment_name)
    return None if router is None else len(router.curr_replicas)
