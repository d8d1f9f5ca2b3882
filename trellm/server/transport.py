"""The HTTP/1.1 connection layer: uvicorn's h11 protocol with a request-header deadline,
and the ``uvicorn.Config`` both ``run_server`` and the tests use.

uvicorn has no deadline for receiving a request's headers (its keep-alive timer is
cancelled by the first byte, and a fresh connection has none), so a client sending
one header byte a second holds a connection forever (slowloris, reliability.md §2
#8). ``GuardedH11Protocol`` closes any connection whose request head is not complete
``header_timeout_s`` after the connection opened or the previous response ended
(408), and refuses a request head over ``MAX_HEADER_BYTES`` (431, CVE-2025-48956).
Its answers, and h11's "bad request", use OpenAI's error shape like every other error.
"""
from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from trellm.server.errors import error_body

MAX_HEADER_BYTES = 16 * 1024
"""A request head (request line and headers) larger than this is refused with 431."""
KEEP_ALIVE_S = 5.0
"""An idle keep-alive connection is closed after this long."""


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, as bytes: h11
    cannot frame a response before it has seen a request."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline and a size limit on each request head."""

    LINGER_S = 1.0
    LINGER_BYTES = 1 << 20

    def __init__(self, *args: Any, header_timeout_s: float = 10.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_cycle: Any = None
        self._head_bytes = 0
        self._head_complete = False
        self._tail = b""
        self._discard: int | None = None
        """Bytes still to drop while lingering after a refusal (None: not refusing)."""

    # The timer runs while the connection waits for a request head: from connection
    # start, and again from the end of each response (keep-alive). A new request
    # cycle object means the head arrived.

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_cycle = self.cycle
        self._head_bytes = 0
        self._head_complete = False
        self._tail = b""
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _check_head(self) -> None:
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._cancel_head_timer()

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.cycle is not self._head_cycle:
            return
        if not self._head_bytes:
            # An idle connection is closed silently: a response there could be taken
            # for the answer to a request the client sends at the same moment.
            self.transport.close()
            return
        self._refuse(408, "Request Timeout", f"the request headers did not arrive within "
                     f"{self.header_timeout_s:g} s", "request_timeout")

    def _count_head(self, data: bytes) -> bool:
        """Count the bytes of the request head being received; True when over the limit.

        h11's own limit (``h11_max_incomplete_event_size``) applies only while a head is
        incomplete: a 100 KB header that arrives in one read passes it (measured)."""
        if self._head_complete or self._head_timer is None:
            return False
        window = self._tail + data
        end = window.find(b"\r\n\r\n")
        if end >= 0:
            self._head_bytes += end + 4 - len(self._tail)
            self._head_complete = True
        else:
            self._head_bytes += len(data)
            self._tail = window[-3:]
        return self._head_bytes > MAX_HEADER_BYTES

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        """Answer, then close gracefully: reading and dropping what the client still
        sends for a moment, since closing with unread data makes the kernel reset the
        connection and the client would see a reset instead of the answer."""
        self._cancel_head_timer()
        self.transport.write(_raw_error(status, reason, message, code))
        self._linger_close()

    def _linger_close(self) -> None:
        self._discard = self.LINGER_BYTES
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.LINGER_S, self.transport.close)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._discard is not None:
            self._discard -= len(data)
            if self._discard < 0:
                self.transport.close()
            return
        if self._count_head(data):
            self._refuse(431, "Request Header Fields Too Large",
                         f"the request headers are larger than {MAX_HEADER_BYTES} bytes", "headers_too_large")
            return
        super().data_received(data)
        self._check_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            if self.cycle is not None and self.cycle.response_complete:
                self._arm_head_timer()
            self._check_head()  # a pipelined request may already have started

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (bad framing; a slow head over MAX_HEADER_BYTES)."""
        self._cancel_head_timer()
        body = json.dumps(error_body(400, "invalid HTTP request", code="bad_http_request")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            self.transport.close()  # a response was already under way: nothing to add
            return
        self._linger_close()


def uvicorn_config(app: Any, *, host: str, port: int, header_timeout_s: float,
                   shutdown_timeout_s: float | None = None, log_level: str | None = None) -> uvicorn.Config:
    """The connection settings of ``trellm serve``, shared with the tests so they test these.

    No ``limit_concurrency``: uvicorn counts open connections toward it, so idle or
    slow connections would turn every other client's requests into 503s. In-flight
    requests are bounded by ``ConcurrencyLimitMiddleware`` instead, and connections
    that make no progress by the header deadline and the keep-alive timeout.
    """
    protocol = functools.partial(GuardedH11Protocol, header_timeout_s=header_timeout_s)
    return uvicorn.Config(app, host=host, port=port, http=protocol, lifespan="on", log_config=None,
                          log_level=log_level, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=shutdown_timeout_s)
