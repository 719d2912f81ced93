"""The Batch API's line formats: OpenAI's input lines, and its output and error lines.

Input, one JSON object a line (blank lines are skipped, as OpenAI does):
    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output (a line whose request ran and answered 2xx):
    {"id": "batch_req_...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

Error file (the request answered 4xx/5xx, or the line itself was unusable):
    {"id": ..., "custom_id": ..., "response": {"status_code": 400, ...} | null,
     "error": {"code": "...", "message": "..."}}

A bad line never fails the whole file: it becomes one error line and the rest still run.
"""

from __future__ import annotations

import codecs
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
MAX_CUSTOM_ID_CHARS = 512
MAX_LINES = 50_000  # OpenAI's limit on requests per batch


@dataclass(frozen=True)
class BatchLine:
    """One runnable request; `line_no` is its 0-based line in the input file."""

    line_no: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    """A line that cannot run; it goes straight to the error file."""

    line_no: int
    custom_id: str | None
    message: str


@dataclass(frozen=True)
class LineResult:
    """One finished line as it is written out: `ok` picks the output or the error file."""

    line_no: int
    custom_id: str | None
    ok: bool
    record: str  # the JSON line, without the newline


def parse_lines(data: bytes, endpoint: str) -> list[BatchLine | LineError]:
    """Every non-blank line of an input file, in order, as a runnable line or an error.

    Raises ValueError only when the file as a whole is unusable (not UTF-8, no lines,
    too many lines); a bad line is a LineError naming what is wrong with it.
    """
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}")
    return parse_split(split_input(data), endpoint)


def parse_split(raw_lines: list[tuple[int, str]], endpoint: str) -> list[BatchLine | LineError]:
    """`parse_lines` over the output of `split_input`."""
    seen: set[str] = set()
    out: list[BatchLine | LineError] = []
    for line_no, raw in raw_lines:
        item = parse_line(line_no, raw, endpoint)
        if isinstance(item, BatchLine):
            if item.custom_id in seen:
                item = LineError(
                    line_no, item.custom_id, f"custom_id {item.custom_id!r} is used twice"
                )
            else:
                seen.add(item.custom_id)
        out.append(item)
    return out


def split_input(data: bytes) -> list[tuple[int, str]]:
    """(line_no, text) of each non-blank line. ValueError if the file cannot be a batch."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the file is not UTF-8 text (byte {e.start})") from None
    lines = [(i, s) for i, s in enumerate(text.splitlines()) if s.strip()]
    if not lines:
        raise ValueError("the file has no lines; a batch needs at least one request")
    if len(lines) > MAX_LINES:
        raise ValueError(f"the file has {len(lines)} lines; a batch holds at most {MAX_LINES}")
    return lines


# What a line holds besides its request body: custom_id (at most 512 characters), method,
# url and the JSON around them. A line may be this much longer than the body limit.
LINE_ENVELOPE_BYTES = 4096
_CHUNK = 1 << 20


def parse_file(
    path: str, endpoint: str, max_body_bytes: int | None = None
) -> list[BatchLine | LineError]:
    """`parse_lines` of the file at `path`, read a line at a time: a line longer than a
    request body may be (`max_body_bytes`, the HTTP limit, plus LINE_ENVELOPE_BYTES) is a
    LineError, skipped without being held in memory, parsed or run."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}")
    limit = None if max_body_bytes is None else max_body_bytes + LINE_ENVELOPE_BYTES
    lines, too_long = split_file(path, limit)
    if not lines and not too_long:
        raise ValueError("the file has no lines; a batch needs at least one request")
    if len(lines) + len(too_long) > MAX_LINES:
        raise ValueError(
            f"the file has {len(lines) + len(too_long)} lines; a batch holds at most {MAX_LINES}"
        )
    items: list[BatchLine | LineError] = [*parse_split(lines, endpoint), *too_long]
    return sorted(items, key=lambda x: x.line_no)


def split_file(
    path: str, max_line_bytes: int | None
) -> tuple[list[tuple[int, str]], list[LineError]]:
    """(line_no, text) of each non-blank line, numbered as `split_input` numbers them (the
    same line breaks), and a LineError for each line past `max_line_bytes`."""
    lines: list[tuple[int, str]] = []
    too_long: list[LineError] = []
    line_no = offset = 0
    with open(path, "rb") as f:
        while True:
            # One "\n"-ended piece; a "\r\n" pair never spans two.
            raw = f.readline() if max_line_bytes is None else f.readline(max_line_bytes + 1)
            if not raw:
                break
            if max_line_bytes is not None and len(raw) > max_line_bytes:
                size = len(raw) + _skip_line(f) if not raw.endswith(b"\n") else len(raw)
                too_long.append(LineError(
                    line_no, None,
                    f"line {line_no + 1} is {size} bytes: a line holds a request body of at "
                    f"most {max_line_bytes - LINE_ENVELOPE_BYTES} bytes (the server's request "
                    f"limit) and {LINE_ENVELOPE_BYTES} bytes of custom_id, method and url",
                ))  # fmt: skip
                line_no += 1
                offset += size
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"the file is not UTF-8 text (byte {offset + e.start})") from None
            offset += len(raw)
            for part in text.splitlines():
                if part.strip():
                    lines.append((line_no, part))
                line_no += 1
    return lines, too_long


def _skip_line(f: Any) -> int:
    """Reads past the rest of the current line, a chunk at a time; the bytes skipped."""
    skipped = 0
    while True:
        chunk = f.readline(_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


class InputCheck:
    """`split_input`'s checks on a file that arrives in chunks (an upload on its way to
    disk), without holding it: UTF-8, at least one non-blank line, at most MAX_LINES (as
    soon as there are more). `feed` each chunk, then `finish`; both raise ValueError."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._offset = 0  # bytes fed before the current chunk
        self._open_line_has_text = False  # the line not yet ended has a non-blank char
        self.num_lines = 0  # non-blank lines ended so far

    def feed(self, chunk: bytes, final: bool = False) -> None:
        held = len(self._decoder.getstate()[0])  # a character's first bytes, cut off
        try:
            text = self._decoder.decode(chunk, final)
        except UnicodeDecodeError as e:
            start = self._offset - held + e.start  # e.start counts the held bytes too
            raise ValueError(f"the file is not UTF-8 text (byte {start})") from None
        self._offset += len(chunk)
        # The same line breaks as str.splitlines. A "\r\n" cut between two chunks reads
        # as a break and an empty line: empty lines are not counted, so the count holds.
        for part in text.splitlines(keepends=True):
            self._open_line_has_text = self._open_line_has_text or bool(part.strip())
            if part.splitlines() != [part]:  # it ends with a line break
                self._end_line()
        if final and self._open_line_has_text:
            self._end_line()

    def finish(self) -> int:
        """The number of non-blank lines; ValueError if the file cannot be a batch."""
        self.feed(b"", final=True)
        if self.num_lines == 0:
            raise ValueError("the file has no lines; a batch needs at least one request")
        return self.num_lines

    def _end_line(self) -> None:
        if self._open_line_has_text:
            self.num_lines += 1
            if self.num_lines > MAX_LINES:
                raise ValueError(
                    f"the file has more than {MAX_LINES} lines; a batch holds at most {MAX_LINES}"
                )
        self._open_line_has_text = False


def first_url(raw_lines: list[tuple[int, str]]) -> str | None:
    """The url of the first line naming a known endpoint: an offline file's endpoint."""
    for _, raw in raw_lines:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("url") in ENDPOINTS:
            return str(obj["url"])
    return None


def parse_line(line_no: int, raw: str, endpoint: str) -> BatchLine | LineError:
    where = f"line {line_no + 1}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return LineError(line_no, None, f"{where} is not valid JSON: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return LineError(line_no, None, f"{where} must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_no, None, f"{where}: custom_id is required (a non-empty string)")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(
            line_no, None, f"{where}: custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters"
        )

    def bad(message: str) -> LineError:
        return LineError(line_no, custom_id, f"{where}: {message}")

    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if extra:
        return bad(f"unknown field {extra[0]!r} (a line has custom_id, method, url, body)")
    if obj.get("method") != "POST":
        return bad(f"method must be 'POST'; got {obj.get('method')!r}")
    url = obj.get("url")
    if url != endpoint:
        return bad(f"url must be the batch's endpoint {endpoint!r}; got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("body must be a JSON object")
    return BatchLine(line_no, custom_id, url, body)


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def response_result(line: BatchLine, status_code: int, request_id: str, body: Any) -> LineResult:
    """The line's HTTP answer: 2xx to the output file, anything else to the error file."""
    ok = 200 <= status_code < 300
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    error = None
    if not ok:
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        error = {
            "code": str(err.get("code") or status_code),
            "message": str(err.get("message") or f"the request failed with {status_code}"),
        }
    record = {"id": _line_id(), "custom_id": line.custom_id, "response": response, "error": error}
    return LineResult(line.line_no, line.custom_id, ok, _dumps(record))


def error_result(line_no: int, custom_id: str | None, code: str, message: str) -> LineResult:
    """A line that never reached a model (unusable line, expired window)."""
    record = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return LineResult(line_no, custom_id, False, _dumps(record))


def invalid_result(err: LineError) -> LineResult:
    return error_result(err.line_no, err.custom_id, "invalid_request", err.message)


def jsonl(records: Iterable[str]) -> bytes:
    return b"".join(r.encode("utf-8") + b"\n" for r in records)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
