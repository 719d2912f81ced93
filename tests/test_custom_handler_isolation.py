"""A custom handler runs in a process of its own (serve/microbatch/isolated.py): what it
raises (BaseException included) is a failed call, a hang ends at timeout_s with the
process restarted and the model unhealthy meanwhile, a dead process is restarted, and a
memory limit holds; the server's process is never touched."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from fleetserve.serve.microbatch.batcher import MicroBatchConfig, MicroBatchItemError
from fleetserve.serve.microbatch.custom import HandlerError
from fleetserve.serve.microbatch.isolated import HandlerCrashedError, HandlerTimeoutError
from fleetserve.serve.microbatch.services import CustomService


def _service(**limits: Any) -> CustomService:
    return CustomService(
        "misbehaves",
        "fleet_handlers:Misbehaves",
        batching=MicroBatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0),
        **limits,
    )


async def _pid(svc: CustomService) -> int:
    (out,) = await svc.predict([{"hello": 1}])
    pid = out["pid"]
    assert pid != os.getpid()  # not the server's process
    return int(pid)


async def _error(svc: CustomService, instance: dict[str, Any]) -> BaseException:
    with pytest.raises(MicroBatchItemError) as info:
        await svc.predict([instance])
    return info.value.error


@pytest.mark.parametrize(
    ("instance", "named"),
    [({"exit": 3}, "SystemExit: 3"), ({"interrupt": True}, "KeyboardInterrupt"),
     ({"base": True}, "BaseException: a bare BaseException")],
)  # fmt: skip
def test_what_a_handler_raises_fails_its_call_only(instance: dict[str, Any], named: str) -> None:
    async def main() -> None:
        svc = _service()
        await svc.start()
        try:
            pid = await _pid(svc)
            err = await _error(svc, instance)
            assert isinstance(err, HandlerError) and named in str(err)
            assert await _pid(svc) == pid  # answered by the same process: nothing died
            assert svc.is_ready and svc.model.num_restarts == 0
        finally:
            await svc.shutdown()

    asyncio.run(main())


def test_a_dead_handler_process_is_restarted() -> None:
    async def main() -> None:
        svc = _service()
        await svc.start()
        try:
            pid = await _pid(svc)
            err = await _error(svc, {"os_exit": 9})
            assert isinstance(err, HandlerCrashedError) and "exit code 9" in str(err)
            assert await _pid(svc) != pid
            assert svc.model.num_restarts == 1 and svc.is_ready
        finally:
            await svc.shutdown()
        assert svc.model.pid is None or not _alive(svc.model.pid)

    asyncio.run(main())


def test_a_hung_call_ends_at_timeout_and_the_model_is_unhealthy_meanwhile() -> None:
    async def main() -> None:
        svc = _service(timeout_s=2.0)
        await svc.start()
        try:
            pid = await _pid(svc)
            started = time.monotonic()
            hung = asyncio.ensure_future(svc.predict([{"sleep": 60}]))
            while svc.unhealthy_reason is None:  # stuck: past half its timeout
                assert not hung.done()
                await asyncio.sleep(0.05)
            assert "a handler call has run" in svc.unhealthy_reason
            assert not svc.is_ready
            with pytest.raises(MicroBatchItemError) as info:
                await hung
            assert isinstance(info.value.error, HandlerTimeoutError)
            assert time.monotonic() - started < 30  # not the 60 s the handler sleeps
            assert not _alive(pid)  # the hung process was killed
            new_pid = await _pid(svc)  # the next call has a new process
            assert new_pid != pid and svc.is_ready and svc.unhealthy_reason is None
        finally:
            await svc.shutdown()

    asyncio.run(main())


def test_a_memory_limit_is_a_memory_error_not_the_oom_killer() -> None:
    async def main() -> None:
        svc = _service(memory_limit_mb=256)
        await svc.start()
        try:
            pid = await _pid(svc)
            (small,) = await svc.predict([{"alloc_mb": 16}])
            assert small == {"allocated": 16 * 2**20}
            err = await _error(svc, {"alloc_mb": 2048})
            assert isinstance(err, HandlerError) and "MemoryError" in str(err)
            assert await _pid(svc) == pid
        finally:
            await svc.shutdown()

    asyncio.run(main())


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
