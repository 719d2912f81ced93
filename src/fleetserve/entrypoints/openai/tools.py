"""Tool calling over the chat API: which mode a request is in, how the tools reach the
prompt, the grammar that enforces `required` and named `tool_choice`, and the calls read
back out of the model's text.

    none      tools rendered (if given), nothing parsed
    auto      the model's own format, read by the model's tool parser
    required  output held by the grammar to a JSON array of {"name", "arguments"} objects,
              one per call, each `arguments` valid against its function's parameters
    named     output held to the named function's parameters schema: it IS the arguments

A chat template that cannot render tools (no `tools` in it) gets fleetserve's tool prompt
in the Hermes format (<tool_call> tags), read by the hermes parser.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from fleetserve.core.structured import StructuredOutputsParams
from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.protocol_tools import NamedToolChoice, ToolChoice, ToolDefinition
from fleetserve.entrypoints.openai.tool_parsers import (
    ParseState,
    ToolParser,
    final_arguments,
    make_parser,
    parser_for_template,
)
from fleetserve.entrypoints.openai.tool_parsers.streaming import ToolCallStream, call_body
from fleetserve.structured.grammars import check, closed_schema

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[ToolDefinition]
    parser: ToolParser | None
    named: str | None
    structured: StructuredOutputsParams | None
    max_calls: int | None

    def stream(self) -> ToolCallStream | None:
        if self.mode == "none":
            return None
        assert self.parser is not None
        return ToolCallStream(self.parser, new_call_id, self.max_calls)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    """The schema a forced call's arguments are held to: objects closed to unlisted keys
    (see closed_schema); the arguments still validate against the function's own."""
    params = tool.function.parameters
    return closed_schema(params) if params is not None else ANY_OBJECT


def _checked(schema: dict[str, Any], field: str) -> StructuredOutputsParams:
    so = StructuredOutputsParams(json=schema)
    try:
        check(so, field, field)
    except ValueError as e:
        raise APIError(400, str(e), field) from None
    return so


def plan_tools(
    tools: list[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    parser_name: str | None,
    chat_template: str | None,
) -> ToolPlan | None:
    """The request's tool mode, or None without tools. 400s for a bad combination."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.function.name in seen:
            raise APIError(
                400, f"tool name {t.function.name!r} is given twice", f"tools.{i}.function.name"
            )
        seen.add(t.function.name)
    max_calls = 1 if parallel_tool_calls is False else None
    name = parser_name or parser_for_template(chat_template)
    choice = tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        index = next((i for i, t in enumerate(tools) if t.function.name == wanted), None)
        if index is None:
            raise APIError(
                400,
                f"tool_choice names {wanted!r}, which is not among the tools "
                f"({', '.join(sorted(seen))})",
                "tool_choice.function.name",
            )
        so = _checked(_parameters(tools[index]), f"tools.{index}.function.parameters")
        return ToolPlan("named", tools, make_parser("json", seen), wanted, so, 1)
    if choice == "required":
        variants = []
        for i, t in enumerate(tools):
            params = _parameters(t)
            _checked(params, f"tools.{i}.function.parameters")
            variants.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        so = _checked(schema, "tools")
        return ToolPlan("required", tools, make_parser("json", seen), None, so, max_calls)
    return ToolPlan(choice, tools, make_parser(name, seen), None, None, max_calls)


# ------------------------------------------------------------------ prompt
def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def tool_prompt(tools: list[ToolDefinition]) -> str:
    """fleetserve's tool prompt (Hermes format) for templates that cannot render tools."""
    lines = [json.dumps(t.model_dump(exclude_none=True)) for t in tools]
    return (
        "You can call functions to help answer. These are the functions you can call, "
        "as JSON signatures inside <tools></tools>:\n<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\nTo call a function, answer with a JSON object holding its name and "
        "its arguments inside <tool_call></tool_call> tags, like this:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n'
        "</tool_call>"
    )


def _arguments_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(
    messages: list[dict[str, Any]], tools: list[ToolDefinition] | None, renders_tools: bool
) -> list[dict[str, Any]]:
    """Messages as the chat template reads them. Assistant tool calls carry their
    arguments as objects (what HF templates expect); without template support for tools
    they become <tool_call> text and tool results <tool_response> user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or []
        if renders_tools:
            if calls:
                m["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _arguments_value(c["function"]["arguments"]),
                        },
                    }
                    for c in calls
                ]
            out.append(m)
            continue
        m.pop("tool_calls", None)
        if calls:
            text = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _arguments_value(c["function"]["arguments"]),
                    }
                )
                + "\n</tool_call>"
                for c in calls
            )
            m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and not renders_tools:
        prompt = tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + prompt).strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---------------------------------------------------------------- response
def parse_final(plan: ToolPlan, text: str) -> ParseState:
    if plan.mode == "named":
        from fleetserve.entrypoints.openai.tool_parsers.base import CallState

        return ParseState("", [CallState(plan.named, text, True)])
    assert plan.parser is not None
    state = plan.parser.parse(text, final=True)
    if plan.max_calls is not None:
        del state.calls[plan.max_calls :]
    return state


def plan_partial(plan: ToolPlan, text: str) -> ParseState:
    assert plan.parser is not None
    state = plan.parser.parse(text, final=False)
    if plan.max_calls is not None:
        del state.calls[plan.max_calls :]
    return state


def message_and_reason(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish_reason."""
    if plan.mode == "none":
        return {"role": "assistant", "content": text}, finish_reason
    # A forced call cut by max_tokens still returns the calls it completed.
    state = parse_final(plan, text) if plan.mode != "required" else plan_partial(plan, text)
    calls = [c for c in state.calls if c.name is not None and c.done]
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {
        "role": "assistant",
        "content": state.content or None,
        "tool_calls": [call_body(new_call_id(), c) for c in calls],
    }
    return message, ("tool_calls" if finish_reason == "stop" else finish_reason)


def named_stream_delta(
    call_id: str, name: str, sent: int, text: str
) -> tuple[dict[str, Any] | None, int]:
    """Named tool_choice: the output is the arguments; the first delta names the call."""
    pieces: list[dict[str, Any]] = []
    if sent == 0 and text:
        pieces.append(
            {
                "index": 0,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )
    if len(text) > sent:
        pieces.append({"index": 0, "function": {"arguments": text[sent:]}})
    return ({"tool_calls": pieces} if pieces else None), len(text)


class ChoiceDeltas:
    """One streamed choice: its text so far -> the delta to send now."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan if plan is not None and plan.mode != "none" else None
        self.sent = 0
        self.calls = self.plan.stream() if self.plan and self.plan.mode != "named" else None
        self.call_id = new_call_id()
        self.text = ""

    def add(self, piece: str, final: bool) -> dict[str, Any]:
        """`piece`: the choice's new text (a stream's delta). Only tool calls need the
        whole text so far (their parser scans it); plain content passes straight through."""
        if self.plan is None:
            return {"content": piece} if piece else {}
        self.text += piece
        return self.delta(self.text, final)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        if self.plan is None:
            piece = text[self.sent :]
            self.sent = len(text)
            return {"content": piece} if piece else {}
        if self.plan.mode == "named":
            assert self.plan.named is not None
            d, self.sent = named_stream_delta(self.call_id, self.plan.named, self.sent, text)
            return d or {}
        assert self.calls is not None
        return self.calls.delta(text, final)

    @property
    def made_calls(self) -> bool:
        if self.plan is not None and self.plan.mode == "named":
            return self.sent > 0
        return self.calls is not None and self.calls.num_calls > 0

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.made_calls else reason


__all__ = [
    "ChoiceDeltas",
    "ToolPlan",
    "final_arguments",
    "message_and_reason",
    "plan_tools",
    "template_messages",
]
