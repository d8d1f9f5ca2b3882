"""A tiny stand-in for a stricter OpenAI-compatible server, served by uvicorn in a
thread: it refuses ignore_eos / min_tokens with a 400 (as OpenAI's own API does),
reports no usage, and answers two magic prompts badly ("BROKEN": a stream that
turns to garbage; "FAIL": a 500), so the bench's error paths run over real HTTP."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FAKE_MODEL = "fake-model"
FAKE_WORDS = (" one", " two", " three", " four", " five")
"""Streamed one per chunk, up to max_tokens of them."""


@dataclass
class FakeServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    bodies: list[dict] = field(default_factory=list)
    """Every POST body received, in arrival order."""

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _app(record: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        record.append(body)
        if "ignore_eos" in body or "min_tokens" in body:
            return JSONResponse({"error": {"message": "Unrecognized request argument supplied: ignore_eos",
                                           "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=400)
        if body["prompt"] == "FAIL":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        return StreamingResponse(_events(body), media_type="text/event-stream")

    return app


async def _events(body: dict):
    if body["prompt"] == "BROKEN":
        yield 'data: {"choices": [{"text": " one"}]}\n\n'
        yield "data: {this is not json\n\n"
        return
    for word in FAKE_WORDS[: body["max_tokens"]]:
        yield "data: " + json.dumps({"choices": [{"index": 0, "text": word}]}) + "\n\n"
    # No usage chunk, though stream_options asked for one: the client must count itself.
    yield "data: [DONE]\n\n"


def start_fake_server() -> FakeServer:
    record: list[dict] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app(record), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"fake-{port}")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake server did not start")
        time.sleep(0.02)
    return FakeServer(f"http://127.0.0.1:{port}", server, thread, record)
