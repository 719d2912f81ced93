"""The server driven by the official `openai` client, sync and async, streaming and not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from server_proc import ServerProc
from transformers import AutoTokenizer

from fleetserve.core.sampling_params import SamplingParams

PROMPT = "The old sailor found a red box"
GREEDY_EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama: str):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_llama)


def greedy(client: openai.OpenAI, prompt: str = PROMPT, max_tokens: int = 24, **kw):  # type: ignore[no-untyped-def]
    return client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=GREEDY_EXTRA,
        **kw,
    )


def test_models(client: openai.OpenAI) -> None:
    (card,) = client.models.list().data
    assert card.id == "tiny"
    assert card.owned_by == "fleetserve"


def test_completion_usage(client: openai.OpenAI, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    resp = greedy(client, max_tokens=12)
    (choice,) = resp.choices
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(hf_tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert choice.text


def test_greedy_matches_offline(client: openai.OpenAI, tiny_llama: str) -> None:
    from fleetserve.engine.llm import LLM

    llm = LLM(tiny_llama)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        (offline,) = llm.generate([PROMPT], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    online = greedy(client).choices[0]
    assert online.text == offline.outputs[0].text


def test_stream_equals_non_stream_completion(client: openai.OpenAI) -> None:
    full = greedy(client).choices[0].text
    chunks = list(greedy(client, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_equals_non_stream_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about the blue door."}]
    kw = dict(
        model="tiny", messages=messages, max_tokens=20, temperature=0, extra_body=GREEDY_EXTRA
    )
    full = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20


def test_stream_include_usage(client: openai.OpenAI) -> None:
    chunks = list(greedy(client, max_tokens=7, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_seed(client: openai.OpenAI) -> None:
    def sample(seed: int):  # type: ignore[no-untyped-def]
        return client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, n=3, temperature=1.0, seed=seed,
            extra_body=GREEDY_EXTRA,
        )  # fmt: skip

    a, b, c = sample(7), sample(7), sample(8)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert a.usage.completion_tokens == 48


def test_chat_n_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
        temperature=1.0, seed=1, stream=True, extra_body=GREEDY_EXTRA,
    )  # fmt: skip
    finished = {c.choices[0].index for c in stream if c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = greedy(client, max_tokens=6, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3
        assert token_lp <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert token_lp == pytest.approx(max(top.values()), abs=1e-4)
        assert token in top
    assert "".join(lp.tokens) == resp.choices[0].text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=GREEDY_EXTRA,
    )  # fmt: skip
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)


def test_echo(client: openai.OpenAI) -> None:
    plain = greedy(client, max_tokens=5).choices[0].text
    echoed = greedy(client, max_tokens=5, echo=True).choices[0].text
    assert echoed == PROMPT + plain


def test_stop_string(client: openai.OpenAI) -> None:
    full = greedy(client, max_tokens=24).choices[0].text
    # A stop string from the middle of the greedy text: output must end right before it.
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    resp = greedy(client, max_tokens=24, stop=[stop])
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in greedy(client, max_tokens=24, stop=stop, stream=True)
    )
    assert streamed == expected


def test_vllm_extra_fields_accepted(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.3, seed=3,
        extra_body={
            "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
            "min_tokens": 8, "stop_token_ids": [2], "priority": 0,
        },
    )  # fmt: skip
    assert resp.usage.completion_tokens == 8


def test_token_id_prompt_and_batch(client: openai.OpenAI, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = hf_tokenizer.encode(PROMPT)
    by_ids = greedy(client, prompt=ids, max_tokens=8).choices[0].text  # type: ignore[arg-type]
    assert by_ids == greedy(client, max_tokens=8).choices[0].text
    batch = greedy(client, prompt=[PROMPT, "Our teacher"], max_tokens=8)  # type: ignore[arg-type]
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_ids


def test_async_client_concurrent(server: ServerProc, client: openai.OpenAI) -> None:
    expected = greedy(client, max_tokens=16).choices[0].text

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0
        ) as ac:

            async def one(stream: bool) -> str:
                kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                          extra_body=GREEDY_EXTRA)  # fmt: skip
                if not stream:
                    return (await ac.completions.create(**kw)).choices[0].text  # type: ignore[call-overload]
                parts = []
                async for chunk in await ac.completions.create(stream=True, **kw):  # type: ignore[call-overload]
                    parts.append(chunk.choices[0].text)
                return "".join(parts)

            return await asyncio.wait_for(
                asyncio.gather(*[one(i % 2 == 0) for i in range(8)]), timeout=60
            )

    assert asyncio.run(main()) == [expected] * 8


def test_the_api_process_never_loads_torch(server: ServerProc, client: openai.OpenAI) -> None:
    """The API process (tokenize, validate, detokenize, HTTP) serves a float32 HF checkpoint
    without importing torch: only its engine process does (~1 s of CPU at every start)."""
    greedy(client, max_tokens=4)
    with open(f"/proc/{server.proc.pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps
    assert server.core_pid is not None
    with open(f"/proc/{server.core_pid}/maps") as f:
        assert "libtorch" in f.read()  # the check can see torch where it is loaded
