"""Which pods a gateway's remote model routes over: a fixed list of URLs, or every address
a DNS name resolves to (a Kubernetes headless Service lists its ready pods), re-resolved
every `refresh_s`.

The model's one pool, "remote", is kept by its PoolController like any other: its target
is the number of addresses, and each replica the controller starts takes an address no
live replica holds (`claim`). A replica whose pod dies is removed by the service's
supervisor and the controller starts another on a free address, which waits until a pod
answers there. When the DNS answer changes, the replicas of addresses that left are
drained (their requests finish or move) and the target follows the new count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Iterable
from typing import Any, Protocol

from fleetserve.serve.config.fleet_config import PoolConfig, RemoteConfig

POOL_NAME = "remote"
# A pod's replica whose address left the DNS answer may finish its requests this long.
_LEFT_DRAIN_S = 10.0

log = logging.getLogger("fleetserve.serve")


class RemoteService(Protocol):
    """What the refresh loop needs of its model's service (serve/services/generate.py)."""

    name: str

    @property
    def replica_set(self) -> Iterable[Any]: ...

    def start_drain(self, index: int, timeout_s: float) -> bool: ...

    def set_pool_target(self, pool: str, replicas: int) -> None: ...


class RemoteTargets:
    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.addresses: list[str] = list(config.urls or [])
        self.api_key: str | None = None
        if config.api_key_env is not None:
            self.api_key = os.environ.get(config.api_key_env)
            if not self.api_key:
                raise ValueError(f"remote.api_key_env: ${config.api_key_env} is not set")

    def pool(self) -> PoolConfig:
        """The model's one pool, sized to the addresses known now (0 until a DNS name
        first resolves)."""
        return PoolConfig(name=POOL_NAME, capacity="on_demand", replicas=len(self.addresses))

    def new_replica(self, index: int, members: Iterable[Any], model: str, config: Any) -> Any:
        """A RemoteReplica of `model` (the pods serve it under the same name) on a free
        address; `config` is the model's EngineConfig (block size, batch size)."""
        from fleetserve.serve.remote.replica import RemoteReplica

        url = self.claim(members)
        replica = RemoteReplica(index, url, model, config, self.api_key,
                                self.config.poll_interval_s)  # fmt: skip
        replica.pool, replica.capacity = POOL_NAME, "on_demand"
        return replica

    def claim(self, members: Iterable[Any]) -> str:
        """The address for a new replica: the first one no live, undrained replica holds."""
        held = [
            getattr(r, "url", None)
            for r in members
            if r.dead_reason is None and not r.draining
        ]  # fmt: skip
        free = [a for a in self.addresses if a not in held]
        if not free:
            raise RuntimeError(f"every address of the pool is taken: {self.addresses}")
        return free[0]

    async def resolve(self) -> list[str]:
        """The URLs the DNS name resolves to now (sorted, so the order is stable)."""
        assert self.config.dns is not None
        host, _, port = self.config.dns.rpartition(":")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        urls = set()
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            shown = f"[{ip}]" if family == socket.AF_INET6 else ip
            urls.add(f"{self.config.scheme}://{shown}:{port}")
        return sorted(urls)

    async def run(self, service: RemoteService) -> None:
        """Follows the DNS name (nothing to do for a fixed list of URLs)."""
        if self.config.dns is None:
            return
        while True:
            try:
                found = await self.resolve()
            except OSError as e:
                log.warning("%s: resolving %s failed: %s", service.name, self.config.dns, e)
            else:
                try:
                    self.update(service, found)
                except Exception:  # the loop must outlive one bad round
                    log.exception("%s: following %s failed", service.name, self.config.dns)
            await asyncio.sleep(self.config.refresh_s)

    def update(self, service: RemoteService, found: list[str]) -> None:
        if found == self.addresses:
            return
        log.info("%s: %s now resolves to %s", service.name, self.config.dns, found)
        self.addresses = found
        # Drained first, so that the controller does not count them when the target moves.
        for r in list(service.replica_set):
            if getattr(r, "url", None) not in found and r.dead_reason is None:
                service.start_drain(r.index, _LEFT_DRAIN_S)
        service.set_pool_target(POOL_NAME, len(found))
