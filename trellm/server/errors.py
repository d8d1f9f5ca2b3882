"""Every error leaves the server in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

That includes FastAPI's and Starlette's own answers (validation 422 -> 400 with the
field in ``param``, 404 unknown route, 405 with ``Allow``, body-parse 400) and
unexpected exceptions (500 with no internals; the traceback goes to the log).
Messages never echo request values: they may be huge, binary, or not valid JSON
(NaN), and echoing them is how the default 422 handler turns into a 500.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

log = logging.getLogger("trellm.server")

_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 421: "invalid_request_error", 422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error", 503: "service_unavailable_error",
}
_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
          413: "request_too_large", 415: "unsupported_media_type", 500: "internal_error"}
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# pydantic puts the union member or validator kind into ``loc`` (e.g. "list[int]",
# "function-after[...]", "str"); those are not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tuple"})


class APIError(Exception):
    """An answer the server chose to give: status, OpenAI error fields, extra headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after_s: int, code: str) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after_s)})


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    etype = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code or _CODES.get(status)}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type=type, param=param, code=code),
                        status_code=status, headers=dict(headers or {}))


def api_error_response(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, param=e.param, code=e.code, type=e.type, headers=e.headers)


def sse_error(e: APIError) -> str:
    """An error event for a stream whose 200 header is already out (then ``[DONE]`` follows)."""
    return f"data: {json.dumps(error_body(e.status, e.message, type=e.type, param=e.param, code=e.code))}\n\n"


async def send_asgi_error(send, status: int, message: str, *, code: str | None = None,
                          headers: Mapping[str, str] | None = None) -> None:
    """Answer from a pure-ASGI middleware (auth, body limits), before any route runs."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def validation_param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query", "path") else list(loc)
    out = ""
    for p in parts:
        if isinstance(p, int):
            if not out:
                break  # a position in the raw JSON text (decode error), not a field
            out += f"[{p}]"
        elif isinstance(p, str) and _FIELD.match(p) and p not in _TYPE_TAGS:
            out += f".{p}" if out else p
        # anything else is a union tag: skip it and keep descending
    return out or None


def _most_telling(errors: list[dict]) -> dict:
    """For a value that fails every member of a union (``stop``: string or list), each
    member reports an error; a plain type mismatch ("should be a valid string") says
    least, so prefer an error from the member whose type did match."""
    for e in errors:
        kind = str(e.get("type", ""))
        if not kind.endswith("_type") and kind != "none_required":
            return e
    return errors[0]


_UNSUPPORTED_FEATURES = {"tools": "tool calling", "tool_choice": "tool calling",
                         "response_format": "structured output (a response_format other than text)"}
"""Fields accepted only in their "off" form: what to call the feature a request asked for."""


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    first = _most_telling(errors) if errors else {"msg": "invalid request", "loc": ()}
    param = validation_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") in ("model_attributes_type", "dict_type", "model_type") and param is None:
        return "the request body must be a JSON object", None
    if first.get("type") == "missing" and param is None:
        return "the request body is missing", None
    if first.get("type") == "none_required" and param is not None:
        # Fields declared only to refuse them (protocol.Unsupported).
        return f"{param} is not supported by this server", param
    feature = _UNSUPPORTED_FEATURES.get((param or "").split(".")[0].split("[")[0])
    if feature is not None:
        return f"{feature} is not supported by this server ({param}: {msg})", param
    if first.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")  # pydantic's prefix on our own validators' messages
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        status = 400 if exc.status_code == 422 else exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if status == 404 and message == "Not Found":
            message = "no such route"
        # Keep the exception's headers: 405 must carry Allow.
        return error_response(status, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.scope.get("path"))
        return error_response(500, "internal server error")
