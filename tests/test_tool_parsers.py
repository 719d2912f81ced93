"""Tool-call parsers, pure: each format's calls read out of the final text, and streamed
one character at a time the deltas add up to exactly the same content and arguments."""

from __future__ import annotations

import json
from itertools import count
from typing import Any

import pytest

from fleetserve.entrypoints.openai.tool_parsers import (
    final_arguments,
    make_parser,
    parser_for_template,
)
from fleetserve.entrypoints.openai.tool_parsers.streaming import ToolCallStream

NAMES = {"get_weather", "get_time"}
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"city": "Oslo \\"old town\\" {x}"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"city": 'Oslo "old town" {x}'})],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {"city": "Rome"}}]',
        "",
        [("get_weather", {"city": "Rome"}), ("get_time", {"city": "Rome"})],
    ),
    (
        "mistral",
        'Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": [1, 2]}'
        '[TOOL_CALLS]get_time[ARGS]{"city": "Rome [old] {x}"}',
        "Checking both.",
        [("get_weather", {"city": "Rome", "days": [1, 2]}), ("get_time", {"city": "Rome [old] {x}"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}',
        "",
        [("get_time", {"city": "Oslo"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
        '{"name": "get_time", "parameters": {"city": "Lima"}}',
        "",
        [("get_weather", {"city": "Lima"}), ("get_time", {"city": "Lima"})],
    ),
    (
        "json",
        '[{"name": "get_time", "arguments": "{\\"city\\": \\"Kyiv\\"}"}]',
        "",
        [("get_time", {"city": "Kyiv"})],
    ),
    ("hermes", "No tools needed: <b>bold</b> and <tool", "No tools needed: <b>bold</b> and <tool", []),
    ("json", '{"city": "not a call"}', '{"city": "not a call"}', []),
    ("json", '{"name": "unknown_fn", "arguments": {}}', '{"name": "unknown_fn", "arguments": {}}', []),
]  # fmt: skip


def _stream(parser_name: str, text: str) -> tuple[str, list[dict[str, Any]]]:
    ids = count()
    stream = ToolCallStream(make_parser(parser_name, NAMES), lambda: f"call_{next(ids)}", None)
    content = ""
    calls: list[dict[str, Any]] = []
    for end in range(1, len(text) + 1):
        delta = stream.delta(text[:end], final=end == len(text))
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(calls)
                calls.append({"name": piece["function"]["name"], "arguments": ""})
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize(("parser_name", "text", "content", "expected"), CASES)
def test_final_and_streamed_parses_agree(
    parser_name: str, text: str, content: str, expected: list[tuple[str, dict[str, Any]]]
) -> None:
    state = make_parser(parser_name, NAMES).parse(text, final=True)
    assert state.content == content
    got = [(c.name, json.loads(final_arguments(c.arguments))) for c in state.calls if c.done]
    assert got == expected
    streamed_content, streamed_calls = _stream(parser_name, text)
    assert streamed_content.strip() == content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == expected


def test_the_template_picks_the_parser() -> None:
    assert parser_for_template(None) == "hermes"
    assert parser_for_template("{{ messages }}") == "hermes"  # no tools: fleetserve's prompt
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for_template("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert parser_for_template("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert parser_for_template("{% for t in tools %}{{ t }}{% endfor %}") == "json"
    with pytest.raises(ValueError, match="tool_parser must be one of"):
        make_parser("nope")


def test_mistral_named_form_partial_call() -> None:
    """A call of the newer form cut by max_tokens: the completed call is done, the cut one
    is not (the response keeps only done calls); no name is guessed from a partial one."""
    parser = make_parser("mistral", NAMES)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_ti'
    state = parser.parse(text, final=False)
    assert [(c.name, c.done) for c in state.calls] == [("get_weather", True), (None, False)]
    state = parser.parse(text + 'me[ARGS]{"city": "Ro', final=True)
    assert [(c.name, c.done) for c in state.calls] == [("get_weather", True), ("get_time", False)]
    assert state.calls[1].arguments == '{"city": "Ro'
    # The partial marker of a next call is held back from the content while streaming.
    assert parser.parse("Sure[TOOL_CA", final=False).content == "Sure"


def test_mistral_named_form_through_the_chat_layer() -> None:
    """`tool_parser: mistral` in auto mode: the response message and the streamed deltas
    of the newer form carry the same calls, finish_reason tool_calls."""
    from fleetserve.entrypoints.openai.protocol_tools import ToolDefinition
    from fleetserve.entrypoints.openai.tools import ChoiceDeltas, message_and_reason, plan_tools

    tools = [
        ToolDefinition.model_validate(
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        )
        for n in sorted(NAMES)
    ]
    plan = plan_tools(tools, "auto", None, "mistral", None)
    assert plan is not None
    text = (
        '[TOOL_CALLS]get_time[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather[ARGS]{"city": "Bergen"}'
    )
    message, reason = message_and_reason(plan, text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert got == [("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
    deltas = ChoiceDeltas(plan)
    streamed: list[dict[str, str]] = []
    for k in range(0, len(text), 5):  # pieces of 5 characters, as a detokenizer would send
        for piece in deltas.add(text[k : k + 5], final=k + 5 >= len(text)).get("tool_calls", []):
            if "id" in piece:
                streamed.append({"name": piece["function"]["name"], "arguments": ""})
            streamed[piece["index"]]["arguments"] += piece["function"]["arguments"]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == got
    assert deltas.finish_reason("stop") == "tool_calls"
