"""Interactive requests keep their place during a Batch API job on an oversubscribed replica.

The fleet's `batch` class oversubscribes the replica (4 batches' worth: 8 sequences for a
batch of 2), so a running job keeps 6 of its lines waiting inside the engine and the rest
in the class queue. An `interactive` request sent then must still be served ahead of all
of them: the engine's priority order, not only the class queue, has to put it first.

Engine steps are paced (FLEETSERVE_DEBUG_STEP_DELAY_S) and the measure is an order: how
many batch lines, all submitted before the probe, start between the probe's send and its
first token (the drop of the `batch` class's not-yet-started count in /metrics). A probe
sent in the `batch` class itself is the control: it waits for every line before it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest
from server_proc import ServerProc, metric, scrape, wait_until

CONFIG = """
models:
  - name: tiny
    model: {model}
    engine: {{max_num_seqs: 2, num_threads: 1, max_model_len: 512}}
classes:
  interactive: {{priority: 0, max_waiting: 16}}
  batch: {{priority: 10, max_waiting: 1000, oversubscribe: 4}}
default_class: interactive
"""
NUM_LINES, LINE_TOKENS = 12, 48  # 2 running + 6 waiting in the engine + 4 in the class queue
NUM_PROBES = 4


@pytest.fixture(scope="module")
def fleet(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    path = tmp_path_factory.mktemp("sla-batch") / "fleet.yaml"
    path.write_text(CONFIG.format(model=tiny_llama))
    env = {"FLEETSERVE_DEBUG_STEP_DELAY_S": "0.03"}
    # Every line of the job is in flight at once: the replica holds 8, the queue the rest.
    srv = ServerProc(None, "--config", str(path), "--batch-concurrency", str(NUM_LINES), env=env)
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.final_output


def _waiting(url: str, cls: str) -> float:
    name = "fleetserve:num_requests_waiting"
    return metric(scrape(url), name, model_name="tiny", **{"class": cls})


def _starts_before_first_token(c: openai.OpenAI, url: str, cls: str, rid: str) -> int:
    """Batch lines that started between this probe's send and its first token."""
    before = _waiting(url, "batch")
    stream = c.completions.create(
        model="tiny", prompt=f"{rid} the", max_tokens=2, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"X-Fleetserve-Class": cls},
    )  # fmt: skip
    after = None
    texts = []
    for chunk in stream:
        if after is None:
            after = _waiting(url, "batch")
        texts.extend(ch.text for ch in chunk.choices)
    assert after is not None and texts, f"probe {rid} got no token"
    return int(before - after)


def test_interactive_is_served_ahead_of_a_running_batch_job(fleet: ServerProc) -> None:
    c = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)
    lines = [
        json.dumps({
            "custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"job {i}: the", "max_tokens": LINE_TOKENS,
                     "ignore_eos": True, "temperature": 0},
        })
        for i in range(NUM_LINES)
    ]  # fmt: skip
    f = c.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = c.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    # The job saturates the replica: its lines are all in, two run and the rest wait.
    assert wait_until(lambda: _waiting(fleet.url, "batch") >= NUM_LINES - 2, 60)
    time.sleep(0.3)  # the runner has handed over every line by now
    assert _waiting(fleet.url, "interactive") == 0

    overtaken = [
        _starts_before_first_token(c, fleet.url, "interactive", f"probe{i}")
        for i in range(NUM_PROBES)
    ]
    # 0 each; a batch line ending in the instant between the scrape and the probe's
    # arrival lets the next one start, which is not an overtake: a little slack.
    assert sum(overtaken) <= 2, overtaken
    # The control, sent in the batch class: every line already waiting goes first,
    # including those in the engine's own queue.
    waiting_now = _waiting(fleet.url, "batch")
    assert waiting_now >= 6, "the job ended too early for the control"
    assert _starts_before_first_token(c, fleet.url, "batch", "control") >= waiting_now - 1

    done = c.batches.retrieve(batch.id)
    deadline = time.monotonic() + 120
    while done.status != "completed":
        assert done.status in ("validating", "in_progress", "finalizing"), done.status
        assert time.monotonic() < deadline, f"batch stuck: {done.request_counts}"
        time.sleep(0.2)
        done = c.batches.retrieve(batch.id)
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (NUM_LINES, 0)
    assert done.output_file_id is not None
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"line-{i}" for i in range(NUM_LINES))
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == LINE_TOKENS for r in out)
    values = scrape(fleet.url)
    ttft = "fleetserve:time_to_first_token_seconds_count"
    assert metric(values, ttft, model_name="tiny", **{"class": "interactive"}) == NUM_PROBES
    assert metric(values, ttft, model_name="tiny", **{"class": "batch"}) == NUM_LINES + 1
    assert metric(values, "fleetserve:num_requests_waiting", model_name="tiny") == 0
