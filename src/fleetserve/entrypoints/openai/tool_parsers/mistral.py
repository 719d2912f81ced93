"""Mistral: [TOOL_CALLS] then a JSON array of {"name", "arguments"} objects."""

from __future__ import annotations

from fleetserve.entrypoints.openai.tool_parsers.base import (
    ParseState,
    ToolParser,
    held_back,
    scan_call,
    skip_ws,
)

MARKER = "[TOOL_CALLS]"


def scan_array(text: str, i: int, state: ParseState) -> None:
    """Calls of the JSON array at text[i] == '[' into `state.calls`."""
    j = skip_ws(text, i + 1)
    while j < len(text) and text[j] == "{":
        call, end = scan_call(text, j)
        if call is None:
            return
        state.calls.append(call)
        if end is None:
            return
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParseState:
        start = text.find(MARKER)
        if start < 0:
            keep = 0 if final else held_back(text, MARKER)
            return ParseState(text[: len(text) - keep])
        state = ParseState(text[:start].rstrip() if final else text[:start])
        j = skip_ws(text, start + len(MARKER))
        if j < len(text) and text[j] == "[":
            scan_array(text, j, state)
        elif j < len(text) and text[j] == "{":
            call, _ = scan_call(text, j)
            if call is not None:
                state.calls.append(call)
        return state
