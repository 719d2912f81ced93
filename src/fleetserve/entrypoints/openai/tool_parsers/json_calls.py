"""Calls written as bare JSON: Llama 3's {"name": ..., "parameters": ...} (optionally
after <|python_tag|>, several joined by ';'), and the generic fallback: the whole output
one call object or an array of them. Output that merely starts like JSON but does not
name a known function stays content."""

from __future__ import annotations

from fleetserve.entrypoints.openai.tool_parsers.base import (
    ParseState,
    ToolParser,
    scan_call,
    skip_ws,
)
from fleetserve.entrypoints.openai.tool_parsers.mistral import scan_array

PYTHON_TAG = "<|python_tag|>"


class JsonToolParser(ToolParser):
    name = "json"

    def __init__(self, function_names: set[str] | None = None) -> None:
        self.function_names = function_names

    def _known(self, state: ParseState) -> bool:
        names = [c.name for c in state.calls]
        if any(n is None for n in names[:-1]):
            return False
        if self.function_names is None:
            return True
        return all(n in self.function_names for n in names if n is not None)

    def parse(self, text: str, final: bool) -> ParseState:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]) and text[i:]:
            return ParseState("")
        if i >= len(text):
            return ParseState("" if not final else text)
        state = ParseState("")
        if text[i] == "[":
            scan_array(text, i, state)
        elif text[i] == "{":
            while i < len(text) and text[i] == "{":
                call, end = scan_call(text, i)
                if call is None:
                    break
                state.calls.append(call)
                if end is None:
                    break
                i = skip_ws(text, end)
                if i < len(text) and text[i] == ";":
                    i = skip_ws(text, i + 1)
        if not state.calls:
            # Not yet known whether JSON-looking output is a call: show nothing yet.
            return ParseState(text if final or text[i] not in "[{" else "")
        if not self._known(state):
            return ParseState(text)
        if not final and state.calls[-1].name is None:
            # Not yet known whether this is a call: show nothing until it is.
            return ParseState("", state.calls[:-1])
        if final and not all(c.done for c in state.calls):
            return ParseState(text)
        return state


class Llama3JsonToolParser(JsonToolParser):
    name = "llama3_json"
