"""A custom handler that calls another model of the fleet (its __init__ takes `fleet`):
across its process boundary, through the callee's own service, with its parent's deadline;
a sub-call to a missing model is a clear error; a parent that times out cancels its
sub-calls (the callee's engine requests end)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest
from server_proc import ServerProc, metric, scrape, wait_until

# The long sub-calls run every token they ask for: tiny's greedy answer to "The sea" meets
# its end-of-sequence token after ~192 (3.8 s at the fleet's 0.02 s a step), a race with a
# 4 s deadline that once ended a sub-call "stop" just before its parent's 504 (CI).
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(pipeline_fleet: ServerProc) -> ServerProc:
    """The session's pipeline fleet (tests/server/pipeline_fleet.py)."""
    return pipeline_fleet


def predict(
    srv: ServerProc,
    instances: list[dict[str, object]],
    headers: dict[str, str] | None = None,
    model: str = "composer",
) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/models/{model}:predict", json={"instances": instances},
                      timeout=60, headers=headers)  # fmt: skip


def test_a_handler_calls_another_model_through_its_service(fleet: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)
    direct = client.completions.create(
        model="tiny", prompt="The sea", max_tokens=4, temperature=0.0
    )
    before = scrape(fleet.url)
    r = predict(fleet, [{"prompt": "The sea"}, {"prompt": "The sea"}])
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert preds == [{"text": direct.choices[0].text, "model": "tiny"}] * 2
    after = scrape(fleet.url)
    key = "fleetserve:generation_tokens_total"
    # The sub-calls are the callee's requests, counted under its model_name.
    assert metric(after, key, model_name="tiny") - metric(before, key, model_name="tiny") == 8


def test_a_sub_call_to_a_missing_model_is_a_clear_error(fleet: ServerProc) -> None:
    r = predict(fleet, [{"prompt": "x", "model": "nope"}])
    assert r.status_code == 200, r.text
    (pred,) = r.json()["predictions"]
    assert pred["status"] == 404 and "'nope' does not exist" in pred["error"]


def test_a_parent_past_its_deadline_cancels_its_sub_calls(fleet: ServerProc) -> None:
    # 450 tokens at 0.02 s a step (9 s) outlast the handler's timeout_s of 3 s.
    aborted = "fleetserve:request_success_total"
    before = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
    r = predict(fleet, [{"prompt": "The sea", "max_tokens": 450, "params": LONG}])
    # The sub-call's deadline is what is left of the parent's: whichever notices first, the
    # parent's timeout (504) or the sub-call's own deadline (its 504 inside the answer).
    if r.status_code == 200:
        (pred,) = r.json()["predictions"]
        assert pred["status"] == 504 and "deadline" in pred["error"], r.text
    else:
        assert r.status_code == 504, r.text

    def sub_call_aborted() -> bool:
        now = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
        return now == before + 1

    # Left running, it would end 'length' after 9+ s; cancelled, it ends 'abort' at once.
    assert wait_until(sub_call_aborted, 5.0)
    # The handler was restarted and serves again.
    assert predict(fleet, [{"prompt": "The sea"}]).status_code == 200


def test_sub_calls_are_admitted_in_the_parents_class(fleet: ServerProc) -> None:
    ttft = "fleetserve:time_to_first_token_seconds_count"

    def counts() -> tuple[float, float]:
        values = scrape(fleet.url)
        return (
            metric(values, ttft, model_name="tiny", **{"class": "batch"}),
            metric(values, ttft, model_name="tiny", **{"class": "interactive"}),
        )

    before = counts()
    r = predict(fleet, [{"prompt": "a"}, {"prompt": "b"}], {"X-Fleetserve-Class": "batch"})
    assert r.status_code == 200, r.text
    # Both sub-calls were the callee's requests in the parent's class, none in the default.
    assert wait_until(lambda: counts() == (before[0] + 2, before[1]), 5.0), counts()
    before = counts()
    assert predict(fleet, [{"prompt": "c"}]).status_code == 200  # no class: the default
    assert wait_until(lambda: counts() == (before[0], before[1] + 1), 5.0), counts()


def test_the_parents_access_line_lists_its_sub_calls(fleet: ServerProc) -> None:
    r = predict(fleet, [{"prompt": "a"}, {"prompt": "x", "model": "nope"}],
                {"X-Request-Id": "parent-with-subcalls"})  # fmt: skip
    assert r.status_code == 200, r.text
    found: list[dict[str, object]] = []

    def logged() -> bool:
        for text in fleet.output().splitlines():
            if text.startswith("{") and "parent-with-subcalls" in text:
                found[:] = [json.loads(text)]
        return bool(found)

    assert wait_until(logged, 10), fleet.output()[-3000:]
    subs = found[0]["sub_calls"]
    assert isinstance(subs, list)
    got = sorted((s["model"], s["method"], s["status"]) for s in subs)
    assert got == [("nope", "complete", 404), ("tiny", "complete", 200)]
    assert all(isinstance(s["ms"], float) and s["ms"] >= 0 for s in subs)


def test_a_handler_process_streams_a_sub_call(fleet: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)
    direct = client.completions.create(
        model="tiny", prompt="The sea", max_tokens=5, temperature=0.0
    )
    r = predict(fleet, [{"prompt": "The sea", "max_tokens": 5}], model="streamer")
    assert r.status_code == 200, r.text
    (pred,) = r.json()["predictions"]
    assert pred["text"] == direct.choices[0].text and pred["chunks"] >= 2
    r = predict(fleet, [{"prompt": "x", "model": "nope"}], model="streamer")
    (pred,) = r.json()["predictions"]
    assert pred["status"] == 404 and "'nope' does not exist" in pred["error"]


def test_a_handler_that_stops_reading_a_stream_ends_its_sub_call(fleet: ServerProc) -> None:
    aborted = "fleetserve:request_success_total"
    before = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
    # 450 tokens at 0.02 s a step would run 9+ s; the handler stops after 2 chunks.
    r = predict(fleet, [{"prompt": "The sea", "max_tokens": 450, "read": 2}], model="streamer")
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0]["chunks"] == 2

    def sub_call_aborted() -> bool:
        now = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
        return now == before + 1

    assert wait_until(sub_call_aborted, 5.0)
    # The handler process reads its pipe in order: its next call is answered as usual.
    r = predict(fleet, [{"prompt": "The sea", "max_tokens": 3}], model="streamer")
    assert r.status_code == 200 and r.json()["predictions"][0]["chunks"] >= 1, r.text


def _tiny_idle(fleet: ServerProc) -> bool:
    """No request of the tiny model running or waiting (a queued one is aborted later)."""
    values = scrape(fleet.url)
    return all(
        metric(values, name, model_name="tiny") == 0
        for name in ("fleetserve:num_requests_running", "fleetserve:num_requests_waiting")
    )


def _tiny_state(fleet: ServerProc) -> dict[str, float]:
    """tiny's finished requests by reason, running and waiting (for a failure's message)."""
    values = scrape(fleet.url)
    state = {
        reason: metric(values, "fleetserve:request_success_total", model_name="tiny",
                       finished_reason=reason)
        for reason in ("abort", "length", "stop")
    }  # fmt: skip
    for name in ("running", "waiting"):
        state[name] = metric(values, f"fleetserve:num_requests_{name}", model_name="tiny")
    return state


async def _leave_once_tiny_runs(fleet: ServerProc) -> bool:
    """Ask `streamer` for a long completion and leave (drop the connection) once its
    sub-call runs in tiny's engine; False if it never got there in 15 s."""
    body = {"instances": [{"prompt": "The sea", "max_tokens": 450, "params": LONG}]}
    async with httpx.AsyncClient(timeout=30.0) as client:
        call = asyncio.ensure_future(client.post(f"{fleet.url}/v1/models/streamer:predict",
                                                 json=body))  # fmt: skip
        end = time.monotonic() + 15.0
        running = False
        while not call.done() and time.monotonic() < end and not running:
            await asyncio.sleep(0.05)
            running = _tiny_state(fleet)["running"] == 1
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
    return running


def test_a_client_that_leaves_cancels_the_parents_sub_calls(fleet: ServerProc) -> None:
    aborted = "fleetserve:request_success_total"
    # Earlier tests' aborted sub-calls counted first (a late one would shift `before`).
    assert wait_until(lambda: _tiny_idle(fleet), 10.0)
    before = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
    # The sub-call would run 9+ s (450 tokens at 0.02 s a step); the client leaves once it
    # runs in tiny's engine, well inside the handler's timeout_s (20 s): only its leaving can
    # end the sub-call. Not ended, it would finish as "length".
    assert asyncio.run(_leave_once_tiny_runs(fleet)), _tiny_state(fleet)

    def sub_call_aborted() -> bool:
        now = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
        return now == before + 1

    assert wait_until(sub_call_aborted, 5.0), (before, _tiny_state(fleet))
    r = predict(fleet, [{"prompt": "The sea", "max_tokens": 3}], model="streamer")
    assert r.status_code == 200, r.text


async def _past_deadline(
    fleet: ServerProc, deadline_ms: int
) -> tuple[httpx.Response, float | None]:
    """`streamer` asked for a long completion within `deadline_ms`: its answer, and how
    many seconds in its sub-call was first seen running in tiny's engine (None: never)."""
    body = {"instances": [{"prompt": "The sea", "max_tokens": 480, "params": LONG}]}
    headers = {"X-Fleetserve-Deadline-Ms": str(deadline_ms)}
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=60.0) as client:
        call = asyncio.ensure_future(client.post(f"{fleet.url}/v1/models/streamer:predict",
                                                 json=body, headers=headers))  # fmt: skip
        ran: float | None = None
        while not call.done():
            await asyncio.sleep(0.05)
            if ran is None and _tiny_state(fleet)["running"] == 1:
                ran = time.monotonic() - start
        return await call, ran


def test_a_parent_past_its_request_deadline_is_a_504_and_ends_its_sub_calls(
    fleet: ServerProc,
) -> None:
    aborted = "fleetserve:request_success_total"
    assert wait_until(lambda: _tiny_idle(fleet), 10.0)
    before = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
    # Far inside the handler's timeout_s (20 s) and the sub-call's 9.6 s (480 tokens at 0.02
    # s a step): only the request's deadline can end it. 6 s leaves a loaded machine time to
    # start the sub-call (0.3 s here beside two busy loops), and the test says so when it
    # never ran.
    r, ran = asyncio.run(_past_deadline(fleet, 6000))
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    assert ran is not None, ("the sub-call never reached tiny's engine", _tiny_state(fleet))

    def sub_call_ended() -> bool:
        # Aborted, and nothing of tiny's left: an un-ended sub-call runs 3.6+ s more.
        now = metric(scrape(fleet.url), aborted, model_name="tiny", finished_reason="abort")
        return now >= before + 1 and _tiny_idle(fleet)

    assert wait_until(sub_call_ended, 3.0), (before, ran, _tiny_state(fleet))
