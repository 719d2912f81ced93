"""The Batch API's line formats: every kind of bad line, and the exact output shapes."""

from __future__ import annotations

import json

import pytest

from fleetserve.batch.lines import (
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_LINES,
    BatchLine,
    LineError,
    error_result,
    first_url,
    invalid_result,
    parse_lines,
    response_result,
    split_input,
)


def _line(custom_id: object = "a", **over: object) -> str:
    obj: dict[str, object] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT_URL,
        "body": {"messages": [{"role": "user", "content": "hi"}]},
    }
    obj.update(over)
    return json.dumps(obj)


def _parse(*lines: str) -> list[BatchLine | LineError]:
    return parse_lines("\n".join(lines).encode(), CHAT_URL)


def test_good_lines_keep_order_and_line_numbers_skip_blank_lines() -> None:
    items = _parse(_line("a"), "", "   ", _line("b"))
    assert [type(x) for x in items] == [BatchLine, BatchLine]
    assert [(x.line_no, x.custom_id) for x in items] == [(0, "a"), (3, "b")]
    assert items[0].body == {"messages": [{"role": "user", "content": "hi"}]}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("raw", "custom_id", "message"),
    [
        ("{nope", None, "line 1 is not valid JSON"),
        ("[1, 2]", None, "line 1 must be a JSON object"),
        (_line(None), None, "custom_id is required"),
        (_line(""), None, "custom_id is required"),
        (_line(7), None, "custom_id is required"),
        (_line("x" * 513), None, "longer than 512"),
        (_line("a", method="GET"), "a", "method must be 'POST'; got 'GET'"),
        (_line("a", url=COMPLETIONS_URL), "a", "url must be the batch's endpoint"),
        (_line("a", url="/v1/other"), "a", "url must be the batch's endpoint"),
        (_line("a", body="text"), "a", "body must be a JSON object"),
        (_line("a", body=None), "a", "body must be a JSON object"),
        (_line("a", extra=1), "a", "unknown field 'extra'"),
    ],
)
def test_bad_line_is_one_error_naming_the_problem(
    raw: str, custom_id: str | None, message: str
) -> None:
    (item,) = _parse(raw)
    assert isinstance(item, LineError)
    assert item.custom_id == custom_id
    assert message in item.message
    assert item.line_no == 0


def test_duplicate_custom_id_errors_the_second_line_only() -> None:
    first, second, third = _parse(_line("a"), _line("a"), _line("b"))
    assert isinstance(first, BatchLine) and isinstance(third, BatchLine)
    assert isinstance(second, LineError)
    assert second.message == "custom_id 'a' is used twice"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b"\n \n", "no lines"),
        (("{}\n" * (MAX_LINES + 1)).encode(), "at most"),
    ],
)
def test_unusable_file_raises(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_input(data)


def test_unknown_endpoint_raises() -> None:
    with pytest.raises(ValueError, match="endpoint must be one of"):
        parse_lines(_line().encode(), "/v1/images")


def test_first_url_skips_bad_lines() -> None:
    raw = split_input(f"{{bad\n{_line(url='/nope')}\n{_line(url=COMPLETIONS_URL)}".encode())
    assert first_url(raw) == COMPLETIONS_URL


def test_output_and_error_line_shapes() -> None:
    line = BatchLine(4, "req-1", CHAT_URL, {})
    ok = response_result(line, 200, "chatcmpl-1", {"id": "chatcmpl-1"})
    assert ok.ok and ok.line_no == 4
    rec = json.loads(ok.record)
    assert rec["id"].startswith("batch_req_")
    assert rec == {
        "id": rec["id"],
        "custom_id": "req-1",
        "response": {"status_code": 200, "request_id": "chatcmpl-1", "body": {"id": "chatcmpl-1"}},
        "error": None,
    }
    body = {"error": {"message": "bad top_p", "type": "invalid_request_error", "code": "x"}}
    bad = response_result(line, 400, "chatcmpl-2", body)
    rec = json.loads(bad.record)
    assert not bad.ok
    assert rec["response"] == {"status_code": 400, "request_id": "chatcmpl-2", "body": body}
    assert rec["error"] == {"code": "x", "message": "bad top_p"}

    invalid = invalid_result(LineError(2, None, "line 3 is not valid JSON"))
    rec = json.loads(invalid.record)
    assert rec["custom_id"] is None and rec["response"] is None
    assert rec["error"] == {"code": "invalid_request", "message": "line 3 is not valid JSON"}
    expired = json.loads(error_result(1, "c", "batch_expired", "late").record)
    assert expired["error"] == {"code": "batch_expired", "message": "late"}
