"""Hermes / Qwen: calls as JSON objects inside <tool_call>...</tool_call> tags, after
any content. Also fleetserve's own format for templates that cannot render tools."""

from __future__ import annotations

from fleetserve.entrypoints.openai.tool_parsers.base import (
    ParseState,
    ToolParser,
    held_back,
    scan_call,
    skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParseState:
        start = text.find(OPEN)
        if start < 0:
            keep = 0 if final else held_back(text, OPEN)
            return ParseState(text[: len(text) - keep])
        state = ParseState(text[:start].rstrip() if final else text[:start])
        i = start
        while i >= 0:
            j = skip_ws(text, i + len(OPEN))
            if j >= len(text) or text[j] != "{":
                break
            call, end = scan_call(text, j)
            if call is None:
                break
            state.calls.append(call)
            if end is None:
                break
            i = text.find(OPEN, end)
        return state
