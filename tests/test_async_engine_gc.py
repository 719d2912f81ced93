"""An AsyncEngine dropped without shutdown() is freed by the cycle collector without hanging.

Collected in one cycle with its sockets, a zmq context's __del__ finds no sockets to close
(their weak references are cleared first) and its term() waits for them for ever: the
fast suite hung in whatever test's allocation happened to trigger that collection."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import threading

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import AsyncEngine


def test_an_engine_dropped_without_shutdown_is_collected(tiny_llama: str) -> None:
    async def start_and_drop() -> subprocess.Popen[bytes]:
        engine = AsyncEngine(EngineArgs(model=tiny_llama, num_threads=1), 64)
        await engine.start()
        proc = engine._proc
        assert proc is not None
        engine.self_ref = engine  # type: ignore[attr-defined]  # only the cycle collector frees it
        return proc

    gc.disable()  # the collection below, not one at a random allocation, must meet the cycle
    try:
        proc = asyncio.run(start_and_drop())
        proc.kill()
        proc.wait(30)
        done = threading.Event()

        def collect() -> None:
            gc.collect()
            done.set()

        threading.Thread(target=collect, daemon=True).start()
        assert done.wait(60), "gc.collect() hung in a zmq context's term()"
    finally:
        gc.enable()
