"""Mistral's two tool-call forms, both after the [TOOL_CALLS] special token:

    [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]     tokenizers v2-v7: a JSON array
    [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}           v11 and later: name, then
                                                               [ARGS] and the arguments,
                                                               one marker per call
    [TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}                 the same with a call id

The name of the newer form is known once [ARGS] (or [CALL_ID]) follows it; its arguments
stream as they are written, like the JSON forms'.
"""

from __future__ import annotations

from fleetserve.entrypoints.openai.tool_parsers.base import (
    CallState,
    ParseState,
    ToolParser,
    held_back,
    scan_call,
    skip_ws,
    value_end,
)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


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


def scan_named_calls(text: str, i: int, state: ParseState) -> None:
    """The newer form's calls: text[i:] starts just after a [TOOL_CALLS] marker."""
    while True:
        args = text.find(ARGS, i)
        if args < 0:
            # The name (and any call id) is still being written.
            state.calls.append(CallState(None, ""))
            return
        name = text[i:args]
        cut = name.find(CALL_ID)
        if cut >= 0:
            name = name[:cut]
        call = CallState(name.strip(), "")
        state.calls.append(call)
        j = skip_ws(text, args + len(ARGS))
        end = value_end(text, j)
        if end is None:
            call.arguments = text[j:]
            return
        call.arguments = text[j:end]
        call.done = True
        k = skip_ws(text, end)
        if not text.startswith(MARKER, k):
            return
        i = k + len(MARKER)


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
        if j >= len(text):
            return state
        if text[j] == "[":
            scan_array(text, j, state)
        elif text[j] == "{":
            call, _ = scan_call(text, j)
            if call is not None:
                state.calls.append(call)
        else:
            scan_named_calls(text, j, state)
        return state
