"""The faults of `fleetserve bench chaos`: a busy replica's process signalled every few
seconds, and what happens next timed from outside (process gone, replica out of the
routing, replacement started and ready).

A `FaultTarget` finds the replicas of one server: fleetserve's through its admin API
(GET /admin/replicas: state, engine pid, requests held), Ray Serve's as the server's
`ray::ServeReplica` worker processes. Every pid is checked to be a descendant of the
server the benchmark started before it is signalled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from fleetserve.bench.local_server import LocalServer, pid_alive

SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}
_POLL_S = 0.05
_PICK_TIMEOUT_S = 30.0  # for a replica that holds requests


@dataclass(frozen=True)
class FaultRecord:
    """One signalled replica; times in seconds after the signal, None if not seen
    (within `measure_timeout_s`) or not knowable for the target."""

    signal: str
    pid: int
    at_s: float  # when it was sent, after the phase's start
    num_requests: int | None  # requests the replica held then (fleetserve only)
    gone_s: float | None  # the process has exited
    out_of_routing_s: float | None  # the server no longer routes to it
    removed_s: float | None  # ... nor lists it (its requests are done or moved)
    replacement_started_s: float | None  # a new replica process exists
    replacement_ready_s: float | None  # ... and serves


class FaultTarget(Protocol):
    server: LocalServer
    # Whether `replica_states` tells ready replicas from others (Ray's processes do not).
    knows_readiness: bool

    def replica_states(self) -> dict[int, str]:
        """pid -> state ("ready", "starting", "draining", "dead"; "running" when unknown)
        for each replica process the server has now."""
        ...

    def busy_replica(self, turn: int) -> tuple[int, int | None] | None:
        """A replica to signal now (its pid and the requests it holds, if known), or None
        if none is busy."""
        ...


class FleetserveTarget:
    knows_readiness = True

    def __init__(self, server: LocalServer) -> None:
        self.server = server

    def _replicas(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.server.url}/admin/replicas", timeout=10)
        resp.raise_for_status()
        return list(resp.json()["data"])

    def replica_states(self) -> dict[int, str]:
        return {r["pid"]: r["state"] for r in self._replicas() if r["pid"] is not None}

    def busy_replica(self, turn: int) -> tuple[int, int | None] | None:
        busy = [
            (r["num_requests"], r["pid"])
            for r in self._replicas()
            if r["state"] == "ready" and r["pid"] is not None and r["num_requests"]
        ]
        if not busy:
            return None
        num_requests, pid = max(busy)  # the busiest: the most requests to move
        return pid, num_requests


class RayServeTarget:
    """The replicas of a Ray Serve app are worker processes titled
    `ray::ServeReplica:<app>:<deployment>`; Serve says nothing of their load or readiness
    from outside, so the replicas are signalled in turn."""

    knows_readiness = False

    def __init__(self, server: LocalServer) -> None:
        self.server = server

    def replica_states(self) -> dict[int, str]:
        out = {}
        for p in self.server.descendants():
            try:
                title = " ".join(p.cmdline())
            except Exception:  # noqa: BLE001 -- gone (or unreadable) meanwhile
                continue
            if title.startswith("ray::ServeReplica") and pid_alive(p.pid):
                out[p.pid] = "running"
        return out

    def busy_replica(self, turn: int) -> tuple[int, int | None] | None:
        pids = sorted(self.replica_states())
        return (pids[turn % len(pids)], None) if pids else None


def _busy_replica(
    target: FaultTarget, turn: int, stop: threading.Event, timeout_s: float
) -> tuple[int, int | None] | None:
    """`target.busy_replica(turn)`, waiting up to `timeout_s` (or `stop`) for one."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        picked = target.busy_replica(turn)
        if picked is not None:
            return picked
        time.sleep(_POLL_S)
    return None


def signal_replica(
    target: FaultTarget, sig_name: str, pid: int, measure_timeout_s: float
) -> dict[str, float | None]:
    """Sends `sig_name` to `pid` (a replica of `target`'s server) and times what follows."""
    if not target.server.owns(pid):
        raise RuntimeError(f"pid {pid} is not a process of the benchmark's server")
    before = set(target.replica_states())
    t0 = time.monotonic()
    os.kill(pid, SIGNALS[sig_name])
    seen: dict[str, float | None] = {
        "gone_s": None,
        "out_of_routing_s": None,
        "removed_s": None,
        "replacement_started_s": None,
        "replacement_ready_s": None,
    }
    if not target.knows_readiness:
        del seen["out_of_routing_s"], seen["removed_s"], seen["replacement_ready_s"]
    while time.monotonic() - t0 < measure_timeout_s and any(v is None for v in seen.values()):
        states = target.replica_states()
        # Taken after the look: each time is when the change was seen, an upper bound.
        now = time.monotonic() - t0
        new = {p: s for p, s in states.items() if p not in before}
        if seen["gone_s"] is None and not pid_alive(pid):
            seen["gone_s"] = now
        routed = states.get(pid) == "ready"
        if "out_of_routing_s" in seen and seen["out_of_routing_s"] is None and not routed:
            seen["out_of_routing_s"] = now
        if "removed_s" in seen and seen["removed_s"] is None and pid not in states:
            seen["removed_s"] = now
        if seen["replacement_started_s"] is None and new:
            seen["replacement_started_s"] = now
        new_ready = "ready" in new.values()
        if "replacement_ready_s" in seen and seen["replacement_ready_s"] is None and new_ready:
            seen["replacement_ready_s"] = now
        time.sleep(_POLL_S)
    seen.setdefault("out_of_routing_s", None)
    seen.setdefault("removed_s", None)
    seen.setdefault("replacement_ready_s", None)
    return seen


def run_faults(
    target: FaultTarget,
    sig_name: str,
    num_faults: int,
    interval_s: float,
    stop: threading.Event,
    measure_timeout_s: float = 120.0,
) -> list[FaultRecord]:
    """Signals a busy replica `interval_s` after the start and then every `interval_s`
    (or once the last one is replaced, if later), `num_faults` times or until `stop`
    (the load is over). Runs in its own thread, beside the load."""
    start = time.monotonic()
    records: list[FaultRecord] = []
    for turn in range(num_faults):
        wait = start + interval_s * (turn + 1) - time.monotonic()
        if stop.wait(max(0.0, wait)):
            break
        picked = _busy_replica(target, turn, stop, _PICK_TIMEOUT_S)
        if picked is None:
            break
        pid, num_requests = picked
        at_s = time.monotonic() - start
        seen = signal_replica(target, sig_name, pid, measure_timeout_s)
        records.append(FaultRecord(sig_name, pid, at_s, num_requests, **seen))
    return records
