"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised by handlers; becomes an error response with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": message,
            "type": err_type,
            "param": param,
            "code": code if code is not None else HTTPStatus(status).phrase.lower(),
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code),
        status_code=err.status,
        headers=err.headers,
    )


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error, named by its field path (e.g. `messages.0.role`)."""
    first = e.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if not _is_type_tag(p)]
    param = ".".join(loc) if loc else None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return APIError(400, f"{param} is required", param)
    if first.get("type") == "extra_forbidden":
        return APIError(
            400, f"{param} is not supported by fleetserve", param, code="unsupported_field"
        )
    return APIError(400, f"{param}: {msg}" if param else msg, param)


def from_value_error(e: ValueError) -> APIError:
    """SamplingParams and the engine name the field first: 'top_p must be in (0, 1]'."""
    msg = str(e)
    m = re.match(r"([a-z_]+)(?=[ =])", msg)
    param = m.group(1) if m and m.group(1) not in ("the", "request", "prompt") else None
    if msg.startswith(("prompt", "the prompt")):
        param = "prompt"
    return APIError(400, msg, param)


def _is_type_tag(part: object) -> bool:
    # pydantic adds the chosen union member to the location: ('stop', 'list[str]', 0)
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
