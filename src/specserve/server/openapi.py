"""The OpenAPI document as the server behaves: FastAPI documents a 422 for every body it
validates, but specserve answers 400 (server/errors.py), so the 422s and their schemas go;
generation endpoints document their JSON body and their event stream (each event's data a
chunk or an error object, the last `[DONE]`); with an API key the protected operations say
so (HTTP bearer)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from specserve.server.guard import OPEN_PATHS
from specserve.server.protocol import ErrorResponse

_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
_REF = "#/components/schemas/{model}"


def errors(*statuses: int) -> dict:
    """Documented error responses (every one an ErrorResponse body)."""
    return {s: {"model": ErrorResponse} for s in statuses}


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """A generation endpoint's responses: `body` as JSON, or with stream true server-sent
    events whose data are `chunk` objects (an error object when the request fails midway),
    the last one `[DONE]`."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "pattern": "^\\{",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": _REF.format(model=chunk.__name__)},
                                {"$ref": _REF.format(model="ErrorResponse")},
                            ]
                        },
                    },
                ]
            },
        },
    }
    return {
        200: {
            "model": body,
            "description": f"the completion; with stream true, server-sent "
            f"events whose data are {chunk.__name__} objects, then [DONE]",
            "content": {"text/event-stream": {"schema": event}},
        },
        **errors(400, 401, 404, 408, 413, 415, 429, 503),
    }


def document_openapi(
    app: FastAPI, secured: bool, open_paths=OPEN_PATHS, models: tuple[type[BaseModel], ...] = ()
) -> None:
    """Replace `app.openapi` by the corrected document (built once, on first request);
    `models`: schemas the document must hold that no route names (stream chunks)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title,
            version=app.version,
            routes=app.routes,
            description="OpenAI-compatible completions and chat completions "
            "with adaptive speculative decoding",
        )
        for path, item in doc.get("paths", {}).items():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
                if secured and path not in open_paths:
                    operation["security"] = [{"bearer": []}]
        components = doc.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in _FASTAPI_VALIDATION_SCHEMAS:
            schemas.pop(name, None)
        for model in models:
            schema = model.model_json_schema(ref_template=_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        if secured:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
