"""POST /v1/embeddings (OpenAI's schema) on an EmbedService.

Each input item is one batcher item, so the items of concurrent requests share batches.
`encoding_format: base64` returns each vector's little-endian float32 bytes, as OpenAI does
(the official Python client asks for it by default and decodes it).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fleetserve.engine.embedding_result import EmbeddingResult
from fleetserve.entrypoints.openai.batch_errors import batch_api_error
from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.protocol_embed import MAX_EMBEDDING_INPUTS, EmbeddingRequest


@runtime_checkable
class Embedder(Protocol):
    """What this handler needs of an embed model: EmbedService here, fleetserve.ray's
    client of a Serve deployment on Ray."""

    name: str

    @property
    def dimension(self) -> int: ...

    def check_ready(self) -> None: ...

    async def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> EmbeddingResult: ...


async def create_embedding(service: Embedder, body: EmbeddingRequest) -> dict[str, Any]:
    """The response body; raises APIError (400 bad input, 503 loading/overloaded, 500)."""
    inputs = body.inputs()
    if not inputs:
        raise APIError(400, "input must not be empty", "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise APIError(
            400, f"input has {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS}", "input"
        )
    try:
        service.check_ready()  # the dimension below is known once the model has loaded
    except Exception as e:
        raise batch_api_error(e, "input") from None
    if body.dimensions is not None and body.dimensions != service.dimension:
        raise APIError(
            400,
            f"dimensions: {service.name!r} returns {service.dimension}-dimensional vectors "
            f"and cannot shorten them; omit dimensions or send {service.dimension}",
            "dimensions",
        )
    try:
        result = await service.embed(inputs)
    except Exception as e:
        raise batch_api_error(e, "input") from None
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(vec, body.encoding_format)}
        for i, vec in enumerate(result.vectors)
    ]
    num_tokens = sum(result.num_tokens)
    return {
        "object": "list",
        "data": data,
        "model": service.name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
