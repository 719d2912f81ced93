"""What the embed and custom services raise, as OpenAI-style HTTP errors."""

from __future__ import annotations

from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.serve.microbatch.batcher import (
    MicroBatchItemError,
    MicroBatchOverloadedError,
    MicroBatchStoppedError,
)
from fleetserve.serve.microbatch.isolated import HandlerTimeoutError
from fleetserve.serve.microbatch.services import ServiceNotReadyError

RETRY_AFTER_S = 1


def batch_api_error(e: Exception, field: str) -> APIError:
    """`field` names the request's list of items ("input", "instances")."""
    index: int | None = None
    if isinstance(e, MicroBatchItemError):
        index, e = e.index, e.error  # type: ignore[assignment]
    where = f"{field}[{index}]" if index is not None else field
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(e, MicroBatchOverloadedError):
        return APIError(503, str(e), code="overloaded", headers=retry)
    if isinstance(e, ServiceNotReadyError):
        return APIError(503, str(e), code="loading", headers=retry)
    if isinstance(e, MicroBatchStoppedError):
        return APIError(503, str(e), code="unavailable", headers=retry)
    if isinstance(e, HandlerTimeoutError):
        return APIError(504, f"{where}: {e}", code="timeout")
    if isinstance(e, ValueError):
        # The model (or the user's handler) refused this item: the client's to fix.
        param = f"{field}.{index}" if index is not None else field
        return APIError(400, f"{where}: {e}", param)
    return APIError(500, f"{where} failed: {e}", code="model_error")
