"""POST /v1/models/{name}:predict on a CustomService: {"instances": [...]} ->
{"predictions": [...]}, the KServe / TF Serving V1 convention.

Each instance is one batcher item. If one instance fails, this request fails (V1 has no
per-instance error) with a body naming it, and the batch-mates from other requests do not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from fleetserve.entrypoints.openai.batch_errors import batch_api_error
from fleetserve.entrypoints.openai.protocol_embed import PredictRequest
from fleetserve.serve.microbatch.custom import Instance, Prediction


@runtime_checkable
class Predictor(Protocol):
    """What this handler needs of a custom model: CustomService here, fleetserve.ray's
    client of a Serve deployment on Ray."""

    async def predict(
        self,
        instances: Sequence[Instance],
        class_name: str | None = None,
        sub_calls: list[Any] | None = None,
    ) -> list[Prediction]: ...


async def predict(
    service: Predictor,
    body: PredictRequest,
    class_name: str | None = None,
    sub_calls: list[Any] | None = None,
) -> dict[str, Any]:
    """The response body; raises APIError (400 bad instance, 503, 500 handler failure).
    `class_name`: the request's class, which the handler's sub-calls take; `sub_calls`:
    where its handler's sub-calls are recorded (the request's access-log line)."""
    try:
        predictions = await service.predict(body.instances, class_name, sub_calls)
    except Exception as e:
        raise batch_api_error(e, "instances") from None
    return {"predictions": predictions}
