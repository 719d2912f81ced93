"""A multipart/form-data upload read as it arrives, its file part handed on chunk by chunk.

The Files API's upload can be 200 MB. Nothing here holds the file: each chunk of the
body goes through the multipart parser (python-multipart's, callback-driven) and the
file part's bytes go straight to `sink` (the store's file being written, and the line
checks), so memory stays at one chunk whatever the file's size. The bounds are enforced
as the bytes arrive: the file's size (413 as soon as it is passed), the whole body's, the
time between chunks (408), and the number and size of the plain fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from fleetserve.entrypoints.openai.body import ClientGone
from fleetserve.entrypoints.openai.errors import APIError

MAX_FIELDS = 4
MAX_FIELD_BYTES = 1024
# The form's own framing (boundaries, part headers, the plain fields) on top of the file.
FRAMING_BYTES = 64 * 1024


@dataclass(frozen=True)
class Upload:
    """The form's plain fields, and its file part's field name, filename and size (the
    bytes themselves went to the sink); `file_field` None: the form had no file part."""

    fields: dict[str, str]
    file_field: str | None
    filename: str | None
    size: int


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    is_file: bool = False
    data: bytearray = field(default_factory=bytearray)


class _FormReader:
    """The parser's callbacks: one file part to the sink, up to MAX_FIELDS small fields."""

    def __init__(self, sink: Callable[[bytes], None], max_file_bytes: int) -> None:
        self.sink = sink
        self.max_file_bytes = max_file_bytes
        self.fields: dict[str, str] = {}
        self.file_field: str | None = None
        self.filename: str | None = None
        self.size = 0
        self._part = _Part()
        self._header_name = bytearray()
        self._header_value = bytearray()
        self.ended = False  # the closing boundary was seen

    def on_part_begin(self) -> None:
        self._part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        self._part.headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._part.headers.get(b"content-disposition"))
        if b"name" not in options:
            raise _bad("a part has no name in its Content-Disposition")
        self._part.name = options[b"name"].decode("utf-8", "replace")
        if b"filename" in options:
            if self.file_field is not None:
                raise _bad("one file per upload")
            self._part.is_file = True
            self.file_field = self._part.name
            self.filename = options[b"filename"].decode("utf-8", "replace")
        elif len(self.fields) >= MAX_FIELDS:
            raise _bad(f"at most {MAX_FIELDS} form fields besides the file")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._part.is_file:
            self.size += len(chunk)
            if self.size > self.max_file_bytes:
                raise APIError(413, f"the file is larger than {self.max_file_bytes} bytes", "file")
            self.sink(chunk)
        else:
            self._part.data += chunk
            if len(self._part.data) > MAX_FIELD_BYTES:
                raise _bad(f"the field {self._part.name!r} is longer than {MAX_FIELD_BYTES} bytes")

    def on_part_end(self) -> None:
        if not self._part.is_file:
            self.fields[self._part.name] = self._part.data.decode("utf-8", "replace")

    def on_end(self) -> None:
        self.ended = True


def _bad(message: str) -> APIError:
    return APIError(400, f"malformed multipart body: {message}", "file")


async def read_upload(
    request: Request, sink: Callable[[bytes], None], max_file_bytes: int, timeout_s: float
) -> Upload:
    """Reads the request's multipart body to its end, the file part's bytes into `sink` as
    they come (its exceptions propagate: a ValueError there is the caller's to turn into
    a 400). 415 if the body is not multipart, 413 past `max_file_bytes`, 408 when no
    chunk came for `timeout_s`, 400 for a malformed form."""
    media_type, params = parse_options_header(request.headers.get("content-type"))
    if media_type != b"multipart/form-data":
        raise APIError(
            415,
            "Content-Type must be multipart/form-data for a file upload",
            code="unsupported_media_type",
        )
    boundary = params.get(b"boundary")
    if not boundary:
        raise _bad("the Content-Type has no boundary")
    limit = max_file_bytes + FRAMING_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the file is larger than {max_file_bytes} bytes", "file")
    reader = _FormReader(sink, max_file_bytes)
    callbacks = {
        name: getattr(reader, name)
        for name in (
            "on_part_begin", "on_header_field", "on_header_value", "on_header_end",
            "on_headers_finished", "on_part_data", "on_part_end", "on_end",
        )
    }  # fmt: skip
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    received = 0
    try:
        async for chunk in _chunks(request, timeout_s):
            received += len(chunk)
            if received > limit:
                raise APIError(413, f"the file is larger than {max_file_bytes} bytes", "file")
            parser.write(chunk)
    except MultipartParseError as e:
        raise _bad(str(e)) from None
    # The parser does not check that the body was whole: a cut-off upload ends here.
    if not reader.ended:
        raise _bad("the body ended before its closing boundary")
    return Upload(reader.fields, reader.file_field, reader.filename, reader.size)


async def _chunks(request: Request, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks; 408 when the client sends nothing for `timeout_s`."""
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout_s)
        except StopAsyncIteration:
            return
        except (TimeoutError, asyncio.TimeoutError):
            raise APIError(
                408, f"the upload stalled for {timeout_s:g} s", code="request_timeout"
            ) from None
        except ClientDisconnect:
            raise ClientGone() from None
        yield chunk
