"""`fleetserve serve --speculative-config`: the engine-core process speculates behind the
unchanged wire; greedy completions (plain and streamed) equal offline decoding without
drafts, and /metrics exports the acceptance counters and gauges."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from server_proc import ServerProc, metric, scrape

from fleetserve import LLM, SamplingParams

PROMPT = "the cat found the cat found the cat found"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_server(tiny_llama: str) -> Iterator[ServerProc]:
    srv = ServerProc(
        tiny_llama, "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC)
    )
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_greedy_completions_equal_offline_without_drafts(
    spec_server: ServerProc, tiny_llama: str
) -> None:
    offline = LLM(tiny_llama).generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0]
    before = scrape(spec_server.url)
    with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0) as c:
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.0)
        resp = c.completions.create(extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
        assert resp.choices[0].text == offline.outputs[0].text
        assert resp.usage.completion_tokens == 40
        chunks = c.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
        assert "".join(ch.choices[0].text for ch in chunks) == offline.outputs[0].text
    after = scrape(spec_server.url)
    drafts = metric(after, "fleetserve:spec_decode_num_draft_tokens_total") - metric(
        before, "fleetserve:spec_decode_num_draft_tokens_total"
    )
    accepted = metric(after, "fleetserve:spec_decode_num_accepted_tokens_total") - metric(
        before, "fleetserve:spec_decode_num_accepted_tokens_total"
    )
    assert 0 < accepted <= drafts
    rate = metric(after, "fleetserve:spec_decode_acceptance_rate")
    assert 0 < rate <= 1
    assert metric(after, "fleetserve:spec_decode_mean_accepted_length") > 1


def test_bad_speculative_config_fails_at_start(tiny_llama: str) -> None:
    srv = ServerProc(tiny_llama, "--speculative-config", '{"method": "ngram"}')
    with pytest.raises(RuntimeError, match="num_speculative_tokens"):
        srv.wait_ready(timeout_s=60)
    srv.stop()
