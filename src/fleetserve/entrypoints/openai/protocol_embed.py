"""Request bodies of the embed and custom endpoints, as strict pydantic models.

`EmbeddingRequest` is OpenAI's POST /v1/embeddings; `PredictRequest` is the KServe / TF
Serving V1 body of POST /v1/models/{name}:predict. Unknown fields are refused (a field
fleetserve does not implement is never accepted and ignored), and nothing is coerced.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's cap on inputs per request
MAX_PREDICT_INSTANCES = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class EmbeddingRequest(_Strict):
    model: str
    # One text, texts, one token-id list, or token-id lists (OpenAI's four forms).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_of_the_four_forms(cls, value: Any) -> Any:
        # pydantic's own message for a failed union names only its first member ("should be
        # a valid string"), which misleads a client that sent [1, true]; say what is allowed.
        def is_id(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        ok = isinstance(value, str) or (
            isinstance(value, list)
            and (
                all(isinstance(x, str) for x in value)
                or all(is_id(x) for x in value)
                or all(isinstance(x, list) and all(is_id(t) for t in x) for x in value)
            )
        )
        if not ok:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids (integers) "
                "or a list of lists of token ids"
            )
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """`input` as a list of items, one per output vector."""
        raw = self.input
        if isinstance(raw, str):
            return [raw]
        if raw and all(isinstance(x, int) for x in raw):
            return [cast(list[int], raw)]
        return cast("list[str] | list[list[int]]", raw)


class PredictRequest(_Strict):
    instances: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_PREDICT_INSTANCES)
