"""The OpenAPI schema says what the server really does, so contract tests
(tests/server/test_schemathesis.py) can hold it to that:

- every error status a route can answer, with the ``ErrorResponse`` body;
- 400 for invalid bodies, not FastAPI's default 422 (errors.py remaps it);
- streamed answers as server-sent events whose ``data`` is a JSON chunk, an error
  object, or ``[DONE]``;
- the served model's name as the example for ``model``, so generated requests get
  past the unknown-model 404 and reach the engine.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from trellm.server.protocol import ChatCompletionChunk, ErrorResponse

ERROR_STATUSES = (400, 401, 404, 405, 408, 413, 415, 421, 500, 503)
_REF = "#/components/schemas/{model}"


def error_responses() -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse} for s in ERROR_STATUSES}


def ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model}, **error_responses()}


def generation_ok(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """200 is ``model`` as JSON, or, with ``stream``, events carrying ``chunk``s."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": _event_schema(chunk)}}},
            **error_responses()}


def _event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: a text/event-stream ``schema`` describes each
    event): ``data`` is a chunk, an error after the 200 header, or the final [DONE]."""
    payload = {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)},
                         {"$ref": _REF.format(model=ErrorResponse.__name__)}]}
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"anyOf": [{"const": "[DONE]"},
                           {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": payload}]}}}


def finish_openapi(app: FastAPI, model_name: str) -> None:
    """Post-process FastAPI's schema once, on first request for it."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            _add_component(components, ChatCompletionChunk)  # only referenced from the event schema
            _set_model_examples(components, model_name)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_component(components: dict[str, Any], model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template=_REF, mode="serialization")
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault(model.__name__, schema)


def _set_model_examples(components: dict[str, Any], model_name: str) -> None:
    for component in components.values():
        if "model" in component.get("properties", {}):
            component["properties"]["model"]["examples"] = [model_name]
        for example in component.get("examples", ()):
            if isinstance(example, dict) and "model" in example:
                example["model"] = model_name
