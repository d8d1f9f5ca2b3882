"""Helpers for the server tests: a live uvicorn server in a thread, request bodies,
and the OpenAI error-shape assertion. Imported by conftest.py and the test modules."""
from __future__ import annotations

import asyncio
import socket
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
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60.0), **kw)

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


def start_server(engine: Engine, config: ServerConfig, **engine_kw) -> LiveServer:
    async_engine = AsyncEngine(engine, max_queued_requests=config.max_queued_requests,
                               engine_step_timeout_s=config.engine_step_timeout_s, **engine_kw)
    app = build_app(async_engine, config, (MODEL_NAME,))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http="h11", lifespan="on", log_level="warning",
                                           timeout_graceful_shutdown=5))
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
