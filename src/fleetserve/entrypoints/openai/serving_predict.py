"""POST /v1/models/{name}:predict on a CustomService: {"instances": [...]} ->
{"predictions": [...]}, the KServe / TF Serving V1 convention.

Each instance is one batcher item. If one instance fails, this request fails (V1 has no
per-instance error) with a body naming it, and the batch-mates from other requests do not.
"""

from __future__ import annotations

from typing import Any

from fleetserve.entrypoints.openai.batch_errors import batch_api_error
from fleetserve.entrypoints.openai.protocol_embed import PredictRequest
from fleetserve.serve.batch_service import CustomService


async def predict(service: CustomService, body: PredictRequest) -> dict[str, Any]:
    """The response body; raises APIError (400 bad instance, 503, 500 handler failure)."""
    try:
        predictions = await service.predict(body.instances)
    except Exception as e:
        raise batch_api_error(e, "instances") from None
    return {"predictions": predictions}
