"""The child side of a custom model's handler process (serve/microbatch/isolated.py starts
it): loads the handler, then answers calls over its pipe until told to stop or the parent
goes away.

Messages, parent -> child: ("call", instances) or ("stop", None). Child -> parent: ("ready",
None) or ("load_error", message) once; then per call ("ok", [slot, ...]) where a slot is
("ok", prediction) | ("value_error", message) | ("error", message), or ("raise_value",
message) / ("raise", message) when the call as a whole raised. Everything the handler
raises, BaseException included (sys.exit, KeyboardInterrupt, MemoryError), becomes a
message: only the death of the process itself (os._exit, a signal, the kernel's OOM
killer) ends it, and the parent restarts it. During a call the child may send
("fleet", (call_id, method, args, kwargs)) and gets ("fleet_reply", (call_id, ok, value))
back (a stream: several), and ("fleet_cancel", call_id) when the handler stops reading a
stream or returns with sub-calls still running: a sub-call of its fleet client
(proc_fleet.py).
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from fleetserve.serve.microbatch.custom import CustomModel, load_handler, run_async
from fleetserve.serve.microbatch.proc_fleet import ProcFleetClient

Message = tuple[str, Any]


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _watch_parent(parent_pid: int) -> None:
    """A hung handler never reads the pipe again: leave when the parent is gone anyway."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _limit_memory(memory_limit_mb: int | None) -> None:
    if memory_limit_mb is None:
        return
    limit = memory_limit_mb * 2**20
    # RLIMIT_DATA: the heap and anonymous mappings (not the shared libraries), so an
    # allocation past the limit is a MemoryError in the handler, not the OOM killer's pick.
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _slot(value: Any) -> Message:
    if isinstance(value, ValueError):
        return ("value_error", str(value))
    if isinstance(value, BaseException):
        # A slot's exception fails that instance with its own message, as in-process.
        return ("error", str(value) or type(value).__name__)
    return ("ok", value)


def _call(model: CustomModel, instances: list[dict[str, Any]]) -> Message:
    try:
        return ("ok", [_slot(v) for v in model(instances)])
    except ValueError as e:
        return ("raise_value", str(e))
    except BaseException as e:  # noqa: BLE001 -- sys.exit, KeyboardInterrupt: answered too
        return ("raise", _describe(e.__cause__ or e) if e.__cause__ else _describe(e))


def main(
    conn: Connection,
    spec: str,
    options: dict[str, Any],
    memory_limit_mb: int | None,
    parent_pid: int,
) -> None:
    # Ctrl-C reaches the whole process group: the server stops this process in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        _limit_memory(memory_limit_mb)
        fleet = ProcFleetClient(conn)
        model = load_handler(spec, options, fleet=fleet)
    except BaseException as e:  # noqa: BLE001 -- a failed load is reported, not raised
        conn.send(("load_error", str(e) if isinstance(e, ValueError) else _describe(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            kind, payload = fleet.kept.pop(0) if fleet.kept else conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if kind == "stop":
            return
        if kind == "fleet_reply":
            continue  # a sub-call the handler did not wait for
        answer = _call(model, payload)
        if fleet.open_calls:  # sub-calls the handler left running end before its answer
            run_async(fleet.settle())
        conn.send(answer)
