"""The local server's uvicorn: the first SIGTERM/SIGINT drains (/health turns 503, new
requests get 503, in-flight ones finish up to --drain-timeout) instead of stopping."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from fleetserve.entrypoints.openai.app_factory import ServerState


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains before exiting instead of stopping."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_timeout = 30.0
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not recorded as captured: uvicorn would re-raise it after serve() and the process
        # would die by the signal instead of exiting 0 after a clean drain.
        if self.loop is None or self.state.draining:
            self.should_exit = True
            if self.state.draining:
                self.force_exit = sig == signal.SIGINT
                self.state.ctx.registry.abort_all("the server is shutting down")
            return
        self.state.draining = True
        self.state.ctx.draining = True
        self.state.ctx.drain_deadline = time.monotonic() + self.drain_timeout
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        registry = self.state.ctx.registry
        while self.state.num_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.num_in_flight > 0:
            registry.abort_all("the server is shutting down (drain timeout)")
            for _ in range(40):
                if self.state.num_in_flight == 0:
                    break
                await asyncio.sleep(0.05)
        self.should_exit = True
