"""A choice's streamed tool calls: each new parse of the text so far is compared with
what was sent, and the difference goes out in OpenAI's delta shape:

    {"content": "..."}                                           text outside calls
    {"tool_calls": [{"index": k, "id", "type": "function",
                     "function": {"name": "f", "arguments": ""}}]}  a call's name is known
    {"tool_calls": [{"index": k, "function": {"arguments": "..."}}]} its arguments grow
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetserve.entrypoints.openai.tool_parsers.base import (
    CallState,
    ParseState,
    ToolParser,
    final_arguments,
)


def call_body(call_id: str, call: CallState) -> dict[str, Any]:
    assert call.name is not None
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": final_arguments(call.arguments)},
    }


class ToolCallStream:
    def __init__(
        self, parser: ToolParser, new_call_id: Callable[[], str], max_calls: int | None
    ) -> None:
        self.parser = parser
        self.new_call_id = new_call_id
        self.max_calls = max_calls
        self.sent_content = 0
        self.call_ids: list[str] = []
        self.sent_arguments: list[int] = []

    def parse(self, text: str, final: bool) -> ParseState:
        state = self.parser.parse(text, final)
        if self.max_calls is not None:
            del state.calls[self.max_calls :]
        return state

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        state = self.parse(text, final)
        out: dict[str, Any] = {}
        if len(state.content) > self.sent_content and not self.call_ids:
            out["content"] = state.content[self.sent_content :]
            self.sent_content = len(state.content)
        pieces: list[dict[str, Any]] = []
        for k, call in enumerate(state.calls):
            if call.name is None:
                break
            if k == len(self.call_ids):
                self.call_ids.append(self.new_call_id())
                self.sent_arguments.append(0)
                pieces.append(
                    {
                        "index": k,
                        "id": self.call_ids[k],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            raw = call.arguments
            # Arguments written as a JSON string are sent whole, decoded, once done.
            if raw.lstrip().startswith('"'):
                if call.done and self.sent_arguments[k] == 0:
                    piece = final_arguments(raw)
                    self.sent_arguments[k] = len(raw)
                    pieces.append({"index": k, "function": {"arguments": piece}})
                continue
            if len(raw) > self.sent_arguments[k]:
                piece = raw[self.sent_arguments[k] :]
                if self.sent_arguments[k] == 0:
                    piece = piece.lstrip()
                self.sent_arguments[k] = len(raw)
                if piece:
                    pieces.append({"index": k, "function": {"arguments": piece}})
        if pieces:
            out["tool_calls"] = pieces
        return out

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)
