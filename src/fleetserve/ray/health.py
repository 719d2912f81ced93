"""A Ray generate replica's watch over its own engine: what serve/replicas/supervisor.py does for
the local server's replicas, for the one engine inside a Serve replica.

- Hung: while the engine holds work and has run no step for `hang_timeout_s`, its
  requests are handed over at once (ReplicaGoneError: each call ends "gone" and the
  ingress resumes it on another replica, request migration) and the engine process is
  killed. Serve's health check alone would only notice a dead process, and only every
  `health_check_period_s`; a hung one answers nothing and dies of nothing.
- Notice: SIGTERM to the engine process (what Kubernetes sends a pod) makes the core send
  a notice with a deadline `sigterm_grace_s` away. The replica drains as a local one
  does: it takes nothing new (new calls end "gone" and go elsewhere; its routing stats
  say `draining`, so the router stops picking it), lets short requests finish, hands the
  rest over before the deadline (serve/replicas/supervisor.py's margin), and then reports itself
  unhealthy, so that Serve replaces it.

`health_error()` is what `check_health` raises; Serve then stops the replica and starts
another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from fleetserve.engine.wire import CoreNotice
from fleetserve.serve.config.fleet_config import ResilienceConfig
from fleetserve.serve.replicas.local import LocalReplica
from fleetserve.serve.replicas.supervisor import SUPERVISE_INTERVAL_S, is_hung, notice_window_s

log = logging.getLogger("fleetserve.ray")


class EngineWatch:
    def __init__(
        self,
        model_name: str,
        replica: LocalReplica,
        resilience: ResilienceConfig,
        interval_s: float = SUPERVISE_INTERVAL_S,
    ) -> None:
        self.model_name = model_name
        self.replica = replica
        self.resilience = resilience
        self.interval_s = interval_s
        # Why the replica must be replaced although its engine may still run (hung, or
        # drained after a notice); None while it serves.
        self.failure: str | None = None
        self.noticed = False  # given a notice: draining from now on
        self._tasks: set[asyncio.Task[Any]] = set()
        replica.on_notice = self.on_notice

    def start(self) -> None:
        self._spawn(self._run())

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    @property
    def draining(self) -> bool:
        """It takes no new requests: drained or being drained, or given up as hung."""
        return self.failure is not None or self.noticed or self.replica.draining

    def health_error(self) -> str | None:
        """Why Serve should replace the replica; None while it is healthy."""
        if self.failure is not None:
            return self.failure
        dead = self.replica.dead_reason
        return None if dead is None else f"the engine is dead: {dead}"

    # ------------------------------------------------------------- hung
    async def _run(self) -> None:
        while self.failure is None:
            await asyncio.sleep(self.interval_s)
            try:
                self.check(time.monotonic())
            except Exception:  # the watch must outlive any one bad check
                log.exception("%s: the engine watch failed", self.model_name)

    def check(self, now: float) -> None:
        """Gives the replica up if its engine is hung (`now`: time.monotonic())."""
        r = self.replica
        if self.failure is not None or r.dead_reason is not None:
            return
        if not is_hung(r, now, self.resilience.hang_timeout_s):
            return
        stalled_s = r.hung_for(now)
        self.failure = (
            f"the engine ran no step for {stalled_s:.1f} s while holding work "
            f"(hang_timeout_s {self.resilience.hang_timeout_s:g}): hung"
        )
        log.error("%s: %s; its requests move, the engine is killed", self.model_name,
                  self.failure)  # fmt: skip
        r.evict_all("the replica hung")
        # A hung process cannot be asked to stop; killing it also makes any call that
        # reaches this replica before Serve replaces it end "gone" (its engine is dead).
        self._spawn(r.stop(kill=True))

    # ------------------------------------------------------------- notice
    def on_notice(self, replica: LocalReplica, notice: CoreNotice) -> None:
        if self.draining:
            return  # already on its way out
        window = notice_window_s(notice, time.time())
        log.warning("%s: the engine got a notice (%s, %s); draining for %.1f s",
                    self.model_name, notice.source, notice.detail, window)  # fmt: skip
        self.noticed = True  # at once: calls from now on go elsewhere
        self._spawn(self._drain(window, notice))

    async def _drain(self, window_s: float, notice: CoreNotice) -> None:
        clean = await self.replica.drain(window_s)
        self.failure = (
            f"drained after a notice ({notice.source}: {notice.detail}); "
            f"{'every request finished here' if clean else 'its unfinished requests moved'}"
        )
        log.warning("%s: %s", self.model_name, self.failure)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
