"""An async streaming client for any OpenAI-compatible server (trellm serve,
llama.cpp's server, vLLM): one streamed request at a time per call, timed
chunk by chunk.

A request never raises: connection failures, non-200 answers, error events and
malformed server-sent events all come back as a failed ``RequestResult`` with a
one-line reason, so a sweep can count them and carry on.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx

from trellm.loader.errors import first_line

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
FIXED_LENGTH_FIELDS = ("ignore_eos", "min_tokens")
"""Non-OpenAI fields (vLLM's, also trellm's and llama.cpp's) that pin the output length."""


class ServerUnreachable(Exception):
    """The server could not be asked for its model list; the message is one line."""


class MalformedStream(ValueError):
    """The response body is not the server-sent events of an OpenAI stream."""


class StreamErrorEvent(Exception):
    """The server sent an error event after the 200 header."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    model: str
    prompt: str
    """Completion prompt, or the user message of a chat request."""
    max_tokens: int
    chat: bool = False
    """POST /v1/chat/completions with one user message instead of /v1/completions."""
    fixed_length: bool = False
    """Also send ignore_eos and min_tokens = max_tokens, so every request yields
    exactly max_tokens tokens where the server honours them."""


@dataclass(frozen=True)
class RequestResult:
    """What one streamed request measured. Times are seconds from sending the request."""

    ok: bool
    e2e_s: float
    """Until the stream ended (or failed)."""
    chunk_times_s: tuple[float, ...] = ()
    """Arrival of each chunk that carried output text; the first is the TTFT."""
    text: str = ""
    completion_tokens: int | None = None
    """From the server's ``usage``; None when it reported none."""
    prompt_tokens: int | None = None
    status: int | None = None
    """HTTP status; None when no response head arrived."""
    error_kind: str | None = None
    """connect, timeout, transport, http_<status>, malformed_sse, stream_error or no_output."""
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None


def request_body(spec: RequestSpec) -> dict:
    """The JSON body: greedy, streamed, usage in the final chunk."""
    body: dict = {"model": spec.model, "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.fixed_length:
        body["ignore_eos"] = True
        body["min_tokens"] = spec.max_tokens
    return body


def api_root(base_url: str) -> str:
    """``http://host:port`` from a base URL with or without a trailing ``/v1``."""
    root = base_url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (several data lines joined by newlines).

    Comments and the standard event/id/retry fields are skipped. Any other line
    raises ``MalformedStream``: the SSE format would ignore it, but from an
    OpenAI-compatible server it means the body is not the stream we asked for.
    """
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, sep, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
        elif not sep or name not in ("event", "id", "retry"):
            raise MalformedStream(f"not a server-sent event line: {line[:80]!r}")
    if data:
        yield "\n".join(data)


@dataclass
class _Accumulator:
    """Folds the JSON chunks of one stream into a result."""

    t0: float
    times: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None

    def add(self, chunk: object, now: float) -> None:
        if not isinstance(chunk, dict):
            raise MalformedStream("a stream chunk is not a JSON object")
        if "error" in chunk:
            err = chunk["error"]
            raise StreamErrorEvent(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            # Some servers repeat usage on every chunk; the last one is the total.
            self.completion_tokens = _int_or_none(usage.get("completion_tokens"))
            self.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        text = "".join(_choice_text(c) for c in chunk.get("choices") or ())
        if text:
            self.times.append(now - self.t0)
            self.parts.append(text)

    def result(self, end: float, status: int) -> RequestResult:
        common = dict(e2e_s=end - self.t0, chunk_times_s=tuple(self.times), text="".join(self.parts),
                      completion_tokens=self.completion_tokens, prompt_tokens=self.prompt_tokens,
                      status=status)
        if not self.times:
            return RequestResult(ok=False, error_kind="no_output", error="the stream carried no output text",
                                 **common)
        return RequestResult(ok=True, **common)


def _json_chunk(data: str) -> object:
    try:
        return json.loads(data)
    except ValueError as e:
        raise MalformedStream(f"a stream chunk is not JSON: {data[:60]!r}") from e


def _choice_text(choice: object) -> str:
    if not isinstance(choice, dict):
        raise MalformedStream("a stream choice is not a JSON object")
    if "delta" in choice:
        delta = choice["delta"] or {}
        if not isinstance(delta, dict):
            raise MalformedStream("a stream delta is not a JSON object")
        # Reasoning models stream their thinking separately; it is generated output too.
        return (delta.get("reasoning_content") or "") + (delta.get("content") or "")
    return choice.get("text") or ""


def _int_or_none(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def describe(e: BaseException) -> str:
    """One line for a transport error: the innermost OS reason when there is one
    (httpx's async path says only "All connection attempts failed")."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cur, OSError) and cur.strerror:
            return cur.strerror
        cur = cur.__cause__ or cur.__context__
    return first_line(e)


def error_message(status: int, body: bytes) -> str:
    """One line: the OpenAI error's message when the body has one, else the body's start."""
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    msg = str(msg) if msg else text.strip()[:200]
    return f"HTTP {status}: " + " ".join(msg.split())


class StreamingClient:
    """Streams completions from one server; share one across concurrent tasks."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 64):
        self.root = api_root(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.root, headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def __aenter__(self) -> "StreamingClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def list_models(self) -> list[str]:
        """The ids GET /v1/models reports; ``ServerUnreachable`` when that fails."""
        try:
            r = await self._http.get(MODELS_PATH, timeout=10.0)
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"cannot reach the server at {self.root}: {describe(e)}") from e
        if r.status_code != 200:
            raise ServerUnreachable(f"GET {self.root}{MODELS_PATH} failed: {error_message(r.status_code, r.content)}")
        try:
            return [str(m["id"]) for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ServerUnreachable(f"GET {self.root}{MODELS_PATH} is not an OpenAI model list") from e

    async def stream(self, spec: RequestSpec) -> RequestResult:
        """Send ``spec`` and read its stream to the end; never raises for server faults."""
        path = CHAT_PATH if spec.chat else COMPLETIONS_PATH
        t0 = time.perf_counter()
        acc = _Accumulator(t0)
        status: int | None = None
        try:
            async with self._http.stream("POST", path, json=request_body(spec)) as resp:
                status = resp.status_code
                if status != 200:
                    msg = error_message(status, await resp.aread())
                    return self._failed(t0, status, f"http_{status}", msg)
                async for data in sse_data(resp.aiter_lines()):
                    if data.strip() == "[DONE]":
                        break
                    acc.add(_json_chunk(data), time.perf_counter())
        except httpx.ConnectError as e:
            return self._failed(t0, status, "connect", describe(e))
        except httpx.TimeoutException as e:
            return self._failed(t0, status, "timeout", f"timed out: {first_line(e)}")
        except httpx.HTTPError as e:
            return self._failed(t0, status, "transport", describe(e))
        except StreamErrorEvent as e:
            return self._failed(t0, status, "stream_error", first_line(e))
        except MalformedStream as e:
            return self._failed(t0, status, "malformed_sse", first_line(e))
        return acc.result(time.perf_counter(), status)

    @staticmethod
    def _failed(t0: float, status: int | None, kind: str, msg: str) -> RequestResult:
        return RequestResult(ok=False, e2e_s=time.perf_counter() - t0, status=status, error_kind=kind, error=msg)
