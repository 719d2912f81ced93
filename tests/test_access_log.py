"""The access-log middleware in process (a small Starlette app; the whole server's lines
are tested in tests/server/test_server_access_log.py): request ids, what each line holds for
streams that moved or failed, quiet paths, a crashing handler, and `--access-log off`."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetserve.entrypoints.openai.access_log import (
    AccessLogMiddleware,
    AccessRecord,
    access_record,
    configure_access_log,
    note_model,
)
from fleetserve.outputs import CompletionOutput, OutputFold, RequestOutput
from fleetserve.serve.request_state import FleetStream, RequestState


class FakeCall:
    """One replica call's stream: yields `outputs` (deltas), then maybe fails."""

    def __init__(self, outputs: list[RequestOutput], fail: Exception | None = None) -> None:
        self.request_id, self.n = "r", 1
        self._outputs = iter(outputs)
        self._fail = fail
        self.closed = False

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return next(self._outputs)
        except StopIteration:
            if self._fail is not None:
                raise self._fail from None
            raise StopAsyncIteration from None

    def close(self) -> None:
        self.closed = True


def stream(call: FakeCall, replicas: list[int]) -> FleetStream:
    """The request's stream, its state as if it had run on `replicas` (the last: now)."""
    state = RequestState("r", 1, "batch", 0, 0.0, OutputFold("r"), replicas[-1],
                         list(replicas), migrations=len(replicas) - 1)  # fmt: skip
    return FleetStream(state, call, service=None)  # type: ignore[arg-type]  # never moved


def output(num_prompt: int, tokens: list[int], finished: bool = False) -> RequestOutput:
    """A delta: `tokens` are the new ones."""
    c = CompletionOutput(0, "x" * len(tokens), tokens, "length" if finished else None)
    return RequestOutput("r", None, list(range(num_prompt)), [c], finished)


async def ok(request: Request) -> Response:
    note_model(request, "tiny", "interactive")
    return PlainTextResponse("ok")


async def boom(request: Request) -> Response:
    raise RuntimeError("handler bug")


async def streamed(request: Request) -> Response:
    record = access_record(request)
    assert record is not None
    note_model(request, "tiny", "batch")
    moved = stream(FakeCall([output(3, []), output(3, [5, 6]), output(3, [7], True)]), [2, 0])
    # First placed where nobody knows (Ray's router picks inside Serve: index -1).
    lost = RuntimeError("replica lost for good")
    failing = stream(FakeCall([output(4, [9])], fail=lost), [-1, 1])
    streams = [moved, failing]
    record.watch([s.state for s in streams], status_of=lambda e: 503)

    async def body() -> AsyncIterator[str]:
        for s in streams:
            try:
                async for _ in s:
                    yield "."
            except RuntimeError:
                yield "error"

    return StreamingResponse(body())


APP = Starlette(
    routes=[
        Route("/ok", ok),
        Route("/boom", boom),
        Route("/stream", streamed),
        Route("/metrics", ok),
    ]  # fmt: skip
)


def reset_logger() -> None:
    """Back to how the process found it (the tests configure the real logger)."""
    logger = logging.getLogger("fleetserve.access")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


@pytest.fixture
def log() -> Iterator[io.StringIO]:
    out = io.StringIO()
    configure_access_log("json", out)
    yield out
    reset_logger()


def run(
    *calls: tuple[str, dict[str, str]], add_header: bool = True
) -> tuple[list[httpx.Response], list[Any]]:
    done: list[Any] = []
    app = AccessLogMiddleware(
        APP,
        on_done=lambda r, s: done.append((r, s)),
        quiet_paths=["/metrics"],
        add_header=add_header,
    )

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.get(path, headers=headers) for path, headers in calls]

    return asyncio.run(main()), done


def lines(log: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.getvalue().splitlines()]


def test_request_ids_kept_when_sane_else_made(log: io.StringIO) -> None:
    sane = "trace-01:a/b+c=d@e.f"
    (a, b, c, d), _ = run(
        ("/ok", {"X-Request-Id": sane}),
        ("/ok", {"X-Request-Id": "x" * 129}),
        ("/ok", {"X-Request-Id": 'quote"d'}),
        ("/ok", {}),
    )
    assert a.headers["x-request-id"] == sane
    made = [r.headers["x-request-id"] for r in (b, c, d)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in made) and len(set(made)) == 3
    got = lines(log)
    assert [x["request_id"] for x in got] == [sane, *made]
    assert got[0]["model"] == "tiny" and got[0]["class"] == "interactive"
    assert got[0]["status"] == 200 and got[0]["method"] == "GET" and got[0]["path"] == "/ok"


def test_behind_a_proxy_that_returns_the_id_the_header_is_left_to_it(
    log: io.StringIO,
) -> None:
    (r,), _ = run(("/ok", {"X-Request-Id": "from-the-proxy"}), add_header=False)
    assert "x-request-id" not in r.headers
    assert lines(log)[0]["request_id"] == "from-the-proxy"


def test_streams_give_replicas_migrations_tokens_and_their_error(log: io.StringIO) -> None:
    (r,), done = run(("/stream", {}))
    assert r.status_code == 200 and r.text.endswith("error")
    (line,) = lines(log)
    assert line["replicas"] == [2, 0, 1] and line["migrations"] == 2
    assert line["prompt_tokens"] == 3 + 4 and line["completion_tokens"] == 3 + 1
    assert 0 < line["ttft_s"] <= line["duration_s"]
    # Sent as a 200, but it ended with an error: the error and the status it stands for.
    assert line["status"] == 200 and line["error"] == "replica lost for good"
    assert line["error_status"] == 503 and line["class"] == "batch"
    ((record, status),) = done
    assert isinstance(record, AccessRecord) and status == 503


def test_quiet_paths_log_only_errors_and_a_crash_is_a_500(log: io.StringIO) -> None:
    (m, b), done = run(("/metrics", {}), ("/boom", {}))
    assert m.status_code == 200 and b.status_code == 500
    assert [x["path"] for x in lines(log)] == ["/boom"]
    assert lines(log)[0]["status"] == 500
    assert [s for _, s in done] == [200, 500]  # on_done still sees every request


def test_off_writes_nothing_and_bad_modes_are_refused() -> None:
    out = io.StringIO()
    configure_access_log("json", out)
    configure_access_log("off")
    try:
        (r,), _ = run(("/ok", {}))
        assert r.headers["x-request-id"] and out.getvalue() == ""
        assert logging.getLogger("fleetserve.access").isEnabledFor(logging.INFO) is False
    finally:
        reset_logger()
    with pytest.raises(ValueError, match="--access-log must be one of json, off"):
        configure_access_log("text")
