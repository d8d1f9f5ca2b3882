"""Pure-ASGI guards that run before any route: Host allowlist, in-flight request cap,
CORS, API key, body size and body deadline.

They read ``scope["path"]`` (what the router matches), never ``request.url``, which
Starlette rebuilds from the Host header (CVE-2026-48710: ``Host: x/health?`` made a
protected path look public).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from typing import Iterable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trellm.server.errors import error_body, send_asgi_error

PUBLIC_PATHS = frozenset({"/health"})
"""Routes that need no key. Everything else is denied by default."""


class AuthMiddleware:
    """Bearer-key check with a constant-time comparison of SHA-256 digests.

    Digests have a fixed length, so ``hmac.compare_digest`` takes the same time
    whatever the presented key's length or its first differing byte (CVE-2025-59425).
    """

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._digest = hashlib.sha256(api_key.encode("utf-8")).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # OPTIONS (CORS preflight) runs no inference and browsers send it without credentials.
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_asgi_error(send, 401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _authorized(self, scope: Scope) -> bool:
        values = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        return hmac.compare_digest(hashlib.sha256(token).digest(), self._digest)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")


class BodyTimeout(HTTPException):
    def __init__(self, seconds: float):
        super().__init__(408, f"the request body did not arrive within {seconds:g} s")


class BodyLimitMiddleware:
    """415 for a POST whose body is not declared JSON, 413 for bodies over the limit and
    408 for bodies that arrive too slowly.

    Requiring ``Content-Type: application/json`` also keeps a web page from starting
    inference on a loopback server: the media types a page may POST without a CORS
    preflight (text/plain, forms, none) are all refused.

    A declared Content-Length over the limit is refused before the app runs. A
    chunked body is counted as it streams in; the route's body read then raises an
    HTTPException, which the app's handlers turn into the OpenAI error shape.

    Either way, up to ``DRAIN_FACTOR`` times the limit of the excess is read and
    discarded first: closing a socket with unread data makes the kernel reset the
    connection, and the client would see "connection reset" instead of the 413.
    Bigger bodies are cut off at once (nothing is ever buffered).
    """

    DRAIN_FACTOR = 4

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, json_paths: frozenset[str] = frozenset()):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.json_paths = json_paths
        """Routes that take a JSON body (POST elsewhere is the router's 404 or 405)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] in self.json_paths and not _is_json(scope):
            await send_asgi_error(send, 415, "the request body must be JSON (Content-Type: application/json)",
                                  code="unsupported_media_type")
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if declared <= self.DRAIN_FACTOR * self.max_bytes:
                await self._drain(receive, 0)
            await send_asgi_error(send, 413, str(BodyTooLarge(self.max_bytes).detail),
                                  headers={"Connection": "close"})
            return
        await self.app(scope, self._limited(receive), send)

    async def _drain(self, receive: Receive, seen: int) -> None:
        """Read and drop the rest of the body, within the cap and the body deadline."""
        deadline = time.monotonic() + self.timeout_s
        while seen <= self.DRAIN_FACTOR * self.max_bytes:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    def _limited(self, receive: Receive) -> Receive:
        seen = 0
        deadline: float | None = None
        done = False

        async def limited() -> Message:
            nonlocal seen, deadline, done
            if done:
                return await receive()  # body complete: only http.disconnect can follow
            deadline = deadline or time.monotonic() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    if not done:
                        await self._drain(receive, seen)
                    raise BodyTooLarge(self.max_bytes)
            return message

        return limited


def _is_json(scope: Scope) -> bool:
    for k, v in scope.get("headers", ()):
        if k == b"content-type":
            media = v.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))
    return False


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


# ---- Host allowlist (DNS rebinding) ---------------------------------------------------------

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_allowlist(bind_host: str, allowed_hosts: Iterable[str]) -> frozenset[str] | None:
    """The Host-header names to accept, or None for any.

    A server bound to loopback is reachable only from this machine, yet a web page can
    still reach it: after DNS rebinding, ``attacker.example`` resolves to 127.0.0.1 and
    the browser sends ``Host: attacker.example``. Only the loopback names (plus the
    bound address and ``--allowed-hosts``) are accepted then. Bound elsewhere, the
    names clients use are unknown, so the check applies only when names are given.
    """
    extra = {h.lower().strip("[]") for h in allowed_hosts}
    if "*" in extra:
        return None
    bind = bind_host.lower().strip("[]")
    loopback = bind in LOOPBACK_NAMES or bind.startswith("127.")
    if not loopback and not extra:
        return None
    names = set(LOOPBACK_NAMES) | extra
    if bind not in ("0.0.0.0", "::", ""):
        names.add(bind)
    return frozenset(names)


def _host_name(value: bytes) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1`` (lower case)."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        return inner if sep and (not rest or (rest[0] == ":" and rest[1:].isdigit())) else text
    name, sep, port = text.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else text


class HostAllowlistMiddleware:
    """421 for a Host header not in the allowlist (``host_allowlist``).

    A request without Host (HTTP/1.0) passes: browsers always send one, so it cannot
    be a rebinding attack.
    """

    def __init__(self, app: ASGIApp, allowed: frozenset[str]):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            hosts = [v for k, v in scope.get("headers", ()) if k == b"host"]
            if len(hosts) > 1 or (hosts and _host_name(hosts[0]) not in self.allowed):
                await send_asgi_error(send, 421, "the Host header names a host this server does not serve "
                                                 "(see --allowed-hosts)", code="invalid_host")
                return
        await self.app(scope, receive, send)


# ---- in-flight request cap ---------------------------------------------------------------


class ConcurrencyLimitMiddleware:
    """503 + Retry-After once ``limit`` HTTP requests are in flight.

    Counts requests, not connections (uvicorn's ``limit_concurrency`` counts both, so
    idle connections could lock every client out). ``/health`` is exempt: it is how
    a supervisor tells "busy" from "dead".
    """

    def __init__(self, app: ASGIApp, limit: int, retry_after_s: int):
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await send_asgi_error(send, 503, f"the server is handling {self.limit} requests; retry later",
                                  code="too_many_requests", headers={"Retry-After": str(self.retry_after_s)})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


# ---- CORS ------------------------------------------------------------------------------------


class OpenAICORSMiddleware(CORSMiddleware):
    """Starlette's CORS with its refused preflight in OpenAI's error shape (400)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        message = bytes(response.body).decode("utf-8", "replace")
        body = json.dumps(error_body(400, message.lower(), code="cors_rejected")).encode()
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return Response(body, status_code=400, headers=headers, media_type="application/json")
