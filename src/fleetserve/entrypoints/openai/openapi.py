"""/openapi.json with the request bodies the handlers really accept.

The handlers read bodies by hand (size and time limits, Unicode checks, OpenAI error
bodies), so FastAPI cannot see their pydantic models; this adds each model's JSON schema
as the route's requestBody, its nested models under components/schemas, so schema-driven
clients and fuzzers learn the API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def install_request_schemas(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> None:
    """`bodies`: POST path -> the pydantic model of its JSON body."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template=_REF)
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
