"""What the pool deployments' autoscaling policies (ray/pool_deployments.py) tell each other: each
policy call records its deployment's replica figures here, and an on-demand pool's policy
reads its model's spot pools from here. All of them run in Serve's controller process.
Its own module, since Serve ships a policy's module to the controller by value
(cloudpickle): state kept there would be a copy per deployment, while this module is
imported by name, so the policies of one controller share one dict."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool deployment as its policy saw it last. `short_since`: since when (the
    controller's clock) fewer replicas have been running than its target; None while
    it has them all."""

    target: int
    running: int
    short_since: float | None


# (application name, deployment name) -> its latest snapshot
SNAPSHOTS: dict[tuple[str, str], PoolSnapshot] = {}
