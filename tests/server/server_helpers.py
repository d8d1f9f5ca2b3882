"""Helpers for the server tests: a live uvicorn server in a thread, request bodies,
and the OpenAI error-shape assertion. Imported by conftest.py and the test modules."""
from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from trellm.config import ServerConfig
from trellm.engine.engine import Engine
from trellm.server.api_server import build_app
from trellm.server.async_engine import AsyncEngine
from trellm.server.transport import uvicorn_config

API_KEY = "test-key-0123456789"
MODEL_NAME = "smollm2"
MAX_MODEL_LEN = 512


@dataclass
class LiveServer:
    """A uvicorn server running ``app`` on 127.0.0.1 in a background thread."""

    app: Any
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    port: int
    api_key: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60.0),
                            verify=_ssl_context(), **kw)

    def openai(self):
        import openai

        # max_retries=0: a retried 5xx would hide a server fault.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=60.0)

    def call(self, fn):
        """Run ``fn(engine)`` on the engine thread between steps, from test code."""
        return asyncio.run_coroutine_threadsafe(self.engine.call(fn), self.loop).result(timeout=60)

    @property
    def loop(self):
        return self.engine._loop

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    # Unused over http://, but httpx builds one per client otherwise (~50 ms each).
    return ssl.create_default_context()


def start_server(engine: Engine, config: ServerConfig, **engine_kw) -> LiveServer:
    """Serve ``engine`` with ``trellm serve``'s app and connection settings (uvicorn_config)."""
    async_engine = AsyncEngine(engine, max_queued_requests=config.max_queued_requests,
                               engine_step_timeout_s=config.engine_step_timeout_s,
                               max_queue_wait_s=config.max_queue_wait_s, **engine_kw)
    app = build_app(async_engine, config, (MODEL_NAME,))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning",
                                           header_timeout_s=config.request_header_timeout_s,
                                           shutdown_timeout_s=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"uvicorn-{port}")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    live = LiveServer(app, async_engine, server, thread, port, config.api_key)
    # Server, engine and test client share 2 cores: one intra-op thread keeps the model
    # from fighting the client (reliability.md §4.3). torch's setting is per thread once
    # a thread has used it, so set it on the engine thread and leave the tests' alone.
    import torch

    live.call(lambda _: torch.set_num_threads(1))
    return live


def chat_body(content: str = "Say hi.", **kw) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **kw}


def completion_body(prompt: Any = "The capital of France is", **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, **kw}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


# ---- raw HTTP: what httpx will not send (bad framing, header floods, slow senders) ----------


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class RawConnection:
    """One TCP connection to the server, written byte by byte if need be."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.port = port
        self._buf = b""

    def __enter__(self) -> "RawConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                host: str | None = None) -> RawResponse:
        self.send(http_request(method, path, body, headers, f"127.0.0.1:{self.port}" if host is None else host))
        return self.read_response()

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self._buf += chunk
        return bool(chunk)

    def read_response(self) -> RawResponse:
        """One response with a Content-Length body (every error and JSON answer has one)."""
        while b"\r\n\r\n" not in self._buf:
            if not self._fill():
                raise ConnectionError(f"closed before a full response head: {self._buf[:200]!r}")
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        size = int(headers.get("content-length", "0"))
        while len(self._buf) < size:
            if not self._fill():
                break
        body, self._buf = self._buf[:size], self._buf[size:]
        return RawResponse(status, headers, body)

    def closed_by_server(self, within: float) -> bool:
        """True when the server closes the connection within ``within`` seconds (any
        bytes it sends first are kept for ``read_response``)."""
        deadline = time.monotonic() + within
        self.sock.settimeout(0.05)
        try:
            while time.monotonic() < deadline:
                try:
                    if not self._fill():
                        return True
                except socket.timeout:
                    continue
                except ConnectionResetError:
                    return True
            return False
        finally:
            self.sock.settimeout(10.0)


def http_request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> bytes:
    hdrs = dict(headers or {})
    if (body or method == "POST") and not {"content-length", "transfer-encoding"} & {k.lower() for k in hdrs}:
        hdrs["Content-Length"] = str(len(body))
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in hdrs.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def assert_raw_openai_error(r: RawResponse, status: int) -> dict:
    assert r.status == status, (r.status, r.body[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def assert_still_serves(live: LiveServer, max_latency_s: float = 10.0) -> None:
    """A normal request right after a hostile one succeeds, promptly, and the engine
    is left holding nothing (no leaked requests or KV blocks)."""
    t0 = time.monotonic()
    with live.client() as c:
        r = c.post("/v1/completions", json=completion_body(prompt="Hello", max_tokens=2, temperature=0))
        assert r.status_code == 200, r.text
        assert c.get("/health").status_code == 200
    assert time.monotonic() - t0 < max_latency_s
    state = wait_engine_idle(live)
    assert not state["busy"] and state["free"] == state["total"], state


def wait_engine_idle(live: LiveServer, timeout: float = 20.0) -> dict:
    """Wait until the engine holds no request; its KV accounting (invariants checked)."""
    def probe(e):
        e.check_invariants()
        return {"busy": e.has_unfinished_requests(), "free": e.kv.num_free_blocks, "total": e.kv.num_blocks,
                "preemptions": e.scheduler.num_preemptions}

    deadline = time.monotonic() + timeout
    while True:
        state = live.call(probe)
        if not state["busy"] or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def slow_steps(live: LiveServer, seconds: float, fail: threading.Event | None = None,
               exc: BaseException | None = None, seen: list | None = None) -> None:
    """Make every engine step take ``seconds``; once ``fail`` is set, steps raise ``exc``
    (default: a RuntimeError). ``seen`` collects the prompt ids of newly scheduled requests."""
    runner = live.engine.engine.worker.runner
    original = runner.execute

    def execute(plan):
        time.sleep(seconds)
        if fail is not None and fail.is_set():
            raise exc if exc is not None else RuntimeError("injected fault: secret internal detail")
        if seen is not None:
            seen.extend(tuple(r.prompt_token_ids) for r in plan.new_requests)
        return original(plan)

    runner.execute = execute


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text page (0.0 when absent)."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if labels:
            found = head.startswith(name + "{") and all(f'{k}="{v}"' in head for k, v in labels.items())
        else:
            found = head == name
        if found:
            return float(value)
    return 0.0
