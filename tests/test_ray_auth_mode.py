"""One Ray authentication mode for the whole test session (conftest.py pins RAY_AUTH_MODE).

A plain local `ray.init()` turns token authentication on for its process (Ray 2.60: the
environment variable and the process's cached config); the fixtures that start one restore
os.environ after, which drops the variable but not the cached mode. A simulated cluster
started later by the same pytest worker (tests/ray_cluster.py) then ran without tokens,
while this process, its driver, still demanded them on incoming calls: the cluster's
workers could not report to it. Actors it owned died at creation, and the replicas'
streamed returns never reached a driver-side deployment handle (test_pipelines_ray.py's
asks of the small replica: "Timed out resolving to ObjectRef", or a hang). This module
replays that order: a local Ray, then a simulated cluster, in one process."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ray_cluster import ray_cluster

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")


@ray.remote(num_cpus=1)
class Counter:
    def plain(self) -> int:
        return 7

    def count(self, n: int) -> Iterator[int]:
        # Not `yield from range(n)`: Ray's executor sends into the generator, which a
        # range iterator refuses.
        for i in range(n):  # noqa: UP028
            yield i


def test_a_cluster_after_a_local_ray_reaches_its_driver() -> None:
    assert "RAY_AUTH_MODE" in os.environ, "conftest.py pins Ray's authentication mode"
    saved = dict(os.environ)
    # As the `ray_local` unit's fixtures do (test_ray_batch.py): a local Ray of its own,
    # then the environment restored.
    ray.init(address="local", num_cpus=1, include_dashboard=False,
             object_store_memory=80 * 2**20, log_to_driver=False)  # fmt: skip
    ray.shutdown()
    os.environ.clear()
    os.environ.update(saved)
    with ray_cluster(num_workers=1, worker_cpus=1):
        counter = Counter.remote()  # owned by this process
        assert ray.get(counter.plain.remote(), timeout=60) == 7
        # A streamed call's items are reported by the worker to this process (the path a
        # Serve deployment handle's every call takes).
        items = counter.count.options(num_returns="streaming").remote(3)
        assert [ray.get(ref, timeout=30) for ref in items] == [0, 1, 2]
