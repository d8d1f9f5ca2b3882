"""Pure-ASGI guards that run before any route: API key, body size and body deadline.

They read ``scope["path"]`` (what the router matches), never ``request.url``, which
Starlette rebuilds from the Host header (CVE-2026-48710: ``Host: x/health?`` made a
protected path look public).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trellm.server.errors import send_asgi_error

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
    """413 for bodies over the limit and 408 for bodies that arrive too slowly.

    A declared Content-Length over the limit is refused before the app runs. A
    chunked body is counted as it streams in; the route's body read then raises an
    HTTPException, which the app's handlers turn into the OpenAI error shape.

    Either way, up to ``DRAIN_FACTOR`` times the limit of the excess is read and
    discarded first: closing a socket with unread data makes the kernel reset the
    connection, and the client would see "connection reset" instead of the 413.
    Bigger bodies are cut off at once (nothing is ever buffered).
    """

    DRAIN_FACTOR = 4

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
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


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None
