"""A custom model's handler in a process of its own: nothing the handler raises or does
reaches the server or the other models.

The boundary is a process per custom model (per Serve replica on Ray), spawned fresh (no
fork of a server holding engines, sockets and threads) and joined by a pipe
(handler_proc.py has the messages). The server's side, `HandlerProcess`, is called on the
model's batcher thread, one call at a time:

- a call that does not answer within `timeout_s` is ended: the process is killed, every
  instance of the call fails with HandlerTimeoutError (HTTP 504; not re-run one by one),
  and a new process starts at once;
- a process that dies during a call (os._exit, a signal, out of memory) fails the call
  with HandlerCrashedError (the batcher then re-runs its instances one by one, so only
  the one that kills the handler fails) and is started again;
- `memory_limit_mb` caps the process's heap (RLIMIT_DATA): past it the handler gets a
  MemoryError, answered as a 500;
- `unhealthy_reason` says why the model cannot serve now: its process is (re)starting, or
  a call has run past half its timeout (stuck); /health, /ready and the dashboard show it.

Handlers call the fleet over the same pipe: a handler whose __init__ takes `fleet` gets a
client (proc_fleet.py) whose sub-calls arrive here as ("fleet", ...) messages while a call
waits; `bind_fleet` (the server, at startup) gives the coroutine that runs one on the
server's event loop through the callee's service (entrypoints/openai/fleet_client.py).
Each sub-call gets the call's remaining time as its deadline, and is cancelled (its engine
requests aborted) when the call ends first (timeout, crash).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from typing import Any

from fleetserve.serve.microbatch import handler_proc
from fleetserve.serve.microbatch.custom import HandlerError, Instance, Prediction

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 600.0
_STOP_WAIT_S = 2.0


class HandlerTimeoutError(HandlerError):
    """The handler did not answer within its model's timeout_s (HTTP 504)."""


class HandlerCrashedError(HandlerError):
    """The handler's process died during the call; it is restarted (HTTP 500)."""


class HandlerProcess:
    def __init__(
        self,
        name: str,
        spec: str,
        options: dict[str, Any],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_limit_mb: int | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.name, self.spec, self.options = name, spec, options
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.num_restarts = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: Any = None  # multiprocessing's SpawnProcess
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one lifecycle change or call at a time
        self._starting = False
        self._stopped = False
        self._call_started: float | None = None  # time.monotonic()
        # Sub-calls (bind_fleet): (method, args, kwargs, timeout_s, the batch's classes,
        # its requests' sub-call records) -> the response body.
        self._fleet: Callable[..., Coroutine[Any, Any, dict[str, Any]]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        # The running call's sub-calls by id; `_abandoned`: its callers all left.
        self._subcalls: dict[int, concurrent.futures.Future[Any]] = {}
        self._abandoned = False

    def bind_fleet(
        self,
        call: Callable[..., Coroutine[Any, Any, dict[str, Any]]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._fleet, self._loop = call, loop

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Blocking: spawn the process and wait for the handler to load; ValueError with
        the handler's own message if it cannot."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        self._starting = True
        try:
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=handler_proc.main,
                args=(child, self.spec, self.options, self.memory_limit_mb, os.getpid()),
                name=f"fleetserve-handler-{self.name}",
                daemon=True,
            )
            proc.start()
            child.close()
            if not parent.poll(LOAD_TIMEOUT_S):
                proc.kill()
                raise ValueError(f"handler {self.spec}: did not load within {LOAD_TIMEOUT_S} s")
            try:
                kind, payload = parent.recv()
            except (EOFError, OSError):
                proc.join(_STOP_WAIT_S)
                raise ValueError(
                    f"handler {self.spec}: its process exited while loading (code {proc.exitcode})"
                ) from None
            if kind != "ready":
                proc.join(_STOP_WAIT_S)
                raise ValueError(str(payload))
            self._proc, self._conn = proc, parent
        finally:
            self._starting = False

    def _restart_locked(self, why: str) -> None:
        self._kill_locked()
        if self._stopped:
            return
        self.num_restarts += 1
        log.warning("model %s: restarting its handler process (%s)", self.name, why)
        try:
            self._start_locked()
        except Exception:  # a handler that no longer loads: the next call tries again
            log.exception("model %s: the handler process did not start again", self.name)

    def _restart_soon(self, why: str) -> None:
        """Kill now; start again on a thread of its own (the failed call answers at once,
        and the next call waits on the lock for the new process)."""
        self._kill_locked()
        self._starting = True
        threading.Thread(target=self._restart_in_background, args=(why,), daemon=True).start()

    def _restart_in_background(self, why: str) -> None:
        with self._lock:
            if self._conn is None and not self._stopped:
                self._restart_locked(why)
            self._starting = False

    def _kill_locked(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        if self._proc is not None:
            self._proc.join(_STOP_WAIT_S)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def stop(self) -> None:
        """Ask the handler to exit, kill it if it does not; no restart after this."""
        self._stopped = True
        conn, proc = self._conn, self._proc
        if conn is not None and proc is not None and self._call_started is None:
            try:
                conn.send(("stop", None))
                proc.join(_STOP_WAIT_S)
            except (OSError, ValueError):
                pass
        if proc is not None and proc.is_alive():
            proc.kill()  # hung in a call: it cannot be asked
            proc.join(_STOP_WAIT_S)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def unhealthy_reason(self) -> str | None:
        if self._stopped:
            return None
        if self._starting:
            return "its handler process is starting"
        if self._proc is None:
            return "its handler process is not running"
        started = self._call_started
        if started is not None and time.monotonic() - started > self.timeout_s / 2:
            return (
                f"a handler call has run {time.monotonic() - started:.0f} s "
                f"(timeout_s {self.timeout_s:g})"
            )
        return None

    # --------------------------------------------------------------------- calls
    def __call__(
        self,
        instances: list[Instance],
        classes: frozenset[str | None] = frozenset(),
        sinks: list[list[Any]] | None = None,
    ) -> list[Prediction | Exception]:
        """The batcher's thread: one result (or Exception) per instance, as CustomModel
        answers; raises ValueError / HandlerError for a call that raised as a whole."""
        with self._lock:
            if self._conn is None:
                if self._stopped:
                    raise HandlerError(f"handler {self.spec}: the model is shutting down")
                self._restart_locked("it was not running")
                if self._conn is None:
                    raise HandlerCrashedError(f"handler {self.spec}: its process does not start")
            conn = self._conn
            self._call_started = time.monotonic()
            subcalls: dict[int, concurrent.futures.Future[Any]] = {}
            self._subcalls, self._abandoned = subcalls, False
            try:
                with self._send_lock:
                    conn.send(("call", instances))
                deadline = time.monotonic() + self.timeout_s
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not conn.poll(remaining):
                        return self._timed_out(len(instances))
                    kind, payload = conn.recv()
                    if kind == "fleet_cancel":  # the handler stopped reading a sub-call
                        if (sub := subcalls.get(payload)) is not None:
                            sub.cancel()
                        continue
                    if kind != "fleet":
                        break
                    sub = self._subcall(conn, payload, remaining, classes, sinks)
                    subcalls[payload[0]] = sub
                    if self._abandoned:  # nobody waits for this call's answer any more
                        sub.cancel()
            except (EOFError, OSError) as e:
                if self._proc is not None:
                    self._proc.join(_STOP_WAIT_S)
                code = self._proc.exitcode if self._proc is not None else None
                self._restart_soon(f"it died during a call: exit code {code}")
                raise HandlerCrashedError(
                    f"handler {self.spec}: its process died during the call (exit code "
                    f"{code}); it was restarted"
                ) from e
            finally:
                self._call_started = None
                for f in subcalls.values():
                    f.cancel()  # the call ended: what it still waits for is cancelled
        if kind == "raise_value":
            raise ValueError(payload)
        if kind == "raise":
            raise HandlerError(f"handler {self.spec} raised {payload}")
        return [self._result(slot) for slot in payload]

    def cancel_sub_calls(self) -> None:
        """Any thread: the running call's sub-calls, and those it makes from now on, are
        cancelled (their engine requests aborted); the handler sees them fail (499)."""
        self._abandoned = True
        for f in list(self._subcalls.values()):
            f.cancel()

    def _subcall(
        self,
        conn: Connection,
        payload: Any,
        remaining_s: float,
        classes: frozenset[str | None] = frozenset(),
        sinks: list[list[Any]] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Runs one sub-call on the server's loop; its answer goes back down the pipe."""
        call_id, method, args, kwargs = payload
        fleet, loop = self._fleet, self._loop
        stream = isinstance(method, str) and method.endswith("_stream")

        def send(answer: tuple[int, bool, Any]) -> None:
            try:
                with self._send_lock:
                    conn.send(("fleet_reply", answer))
            except (OSError, ValueError):
                pass  # the process is gone

        if fleet is None or loop is None:

            async def refuse() -> dict[str, Any]:
                raise RuntimeError("this server gives handlers no fleet client")

            coro = refuse()
        else:
            emit = None
            if stream:  # each chunk goes down the pipe as it comes (on the server's loop)

                def emit(chunk: dict[str, Any]) -> None:
                    send((call_id, True, ("chunk", chunk)))

            coro = fleet(method, args, kwargs, remaining_s, classes, sinks or [], emit=emit)
        loop = loop or asyncio.new_event_loop()
        future = asyncio.run_coroutine_threadsafe(coro, loop)

        def reply(f: concurrent.futures.Future[Any]) -> None:
            # Every sub-call gets its last reply, a cancelled one too: the handler
            # process reads until it has them all (proc_fleet.settle).
            if f.cancelled():
                send((call_id, False, (499, "the sub-call was cancelled")))
                return
            e = f.exception()
            if e is not None:
                send((call_id, False, (getattr(e, "status", 500), str(e))))
            else:
                send((call_id, True, ("end", None) if stream else f.result()))

        future.add_done_callback(reply)
        return future

    def _timed_out(self, n: int) -> list[Prediction | Exception]:
        self._restart_soon(f"a call ran past timeout_s {self.timeout_s:g}")
        error = HandlerTimeoutError(
            f"handler {self.spec} did not answer within timeout_s={self.timeout_s:g} s; "
            "the call was ended and the handler restarted"
        )
        return [error] * n

    def _result(self, slot: tuple[str, Any]) -> Prediction | Exception:
        kind, value = slot
        if kind == "ok":
            return value  # type: ignore[no-any-return]
        if kind == "value_error":
            return ValueError(value)
        return HandlerError(value)
