"""The FastAPI app (``build_app``) and the process around it (``run_server``).

``build_app`` only wires routes, guards and error handlers around an
``AsyncEngine``, so tests can build it in-process (httpx/ASGI) or serve it with
uvicorn on a loopback port. ``run_server`` loads the model, serves, drains on
SIGTERM, and exits non-zero if the engine dies.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from typing import Sequence

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.security import HTTPBearer
from starlette.responses import JSONResponse, Response

from trellm.config import EngineConfig, ServerConfig
from trellm.server.async_engine import AsyncEngine
from trellm.server.errors import error_response, install_error_handlers
from trellm.server.metrics import CONTENT_TYPE, RequestCounterMiddleware, ServerMetrics
from trellm.server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    ConcurrencyLimitMiddleware,
    HostAllowlistMiddleware,
    OpenAICORSMiddleware,
    host_allowlist,
)
from trellm.server.openapi import error_responses, finish_openapi, generation_ok, ok
from trellm.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from trellm.server.serving_base import ServingContext, check_token_ids, in_thread
from trellm.server.serving_chat import create_chat_completion, render_prompt
from trellm.server.serving_completions import create_completion
from trellm.server.transport import uvicorn_config

log = logging.getLogger("trellm.server")

def default_model_names(model: str) -> tuple[str, ...]:
    """vLLM reports the model argument as given; the embedded default gets a short name."""
    if model:
        return (model,)
    from trellm.default_model import FILE_NAME

    return (FILE_NAME.split(".")[0],)


def build_app(engine: AsyncEngine, config: ServerConfig, model_names: Sequence[str] = ("model",),
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine thread and stops it at exit."""
    config.validate()
    metrics = metrics or ServerMetrics()
    if engine.listener is None:
        engine.listener = metrics
    metrics.attach_engine(lambda: engine.stats, lambda: engine.healthy)
    ctx = ServingContext(engine, config, tuple(config.served_model_names or model_names))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        await engine.drain(0.0)
        await engine.stop()

    protected = [Depends(HTTPBearer(auto_error=False))] if config.api_key else []
    app = FastAPI(title="trellm", summary="OpenAI-compatible LLM server", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    # No 307 to the slash-less path: a redirect built from the Host header is no
    # answer for an API client, and a path variant must be a plain 404.
    app.router.redirect_slashes = False
    install_error_handlers(app)
    app.state.ctx = ctx
    app.state.metrics = metrics
    _add_routes(app, ctx, metrics, protected)
    finish_openapi(app, ctx.model_name)
    _add_guards(app, config, engine, metrics)
    return app


def _add_guards(app: FastAPI, config: ServerConfig, engine: AsyncEngine, metrics: ServerMetrics) -> None:
    """The pure-ASGI guards. Added last = outermost: count every answer, refuse foreign
    Host headers, cap in-flight requests, answer CORS preflights (no key needed),
    check the key, then bound the body."""
    routes = frozenset(r.path for r in app.routes if hasattr(r, "path"))
    json_paths = frozenset(r.path for r in app.routes if "POST" in (getattr(r, "methods", None) or ()))
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes,
                       timeout_s=config.request_body_timeout_s, json_paths=json_paths)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        # No allow_credentials: the key travels in a header the page must set itself.
        app.add_middleware(OpenAICORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(ConcurrencyLimitMiddleware, retry_after_s=config.retry_after_s,
                       limit=max(256, 4 * (engine.max_num_seqs + config.max_queued_requests)))
    allowed = host_allowlist(config.host, config.allowed_hosts)
    if allowed is not None:
        app.add_middleware(HostAllowlistMiddleware, allowed=allowed)
    app.add_middleware(RequestCounterMiddleware, metrics=metrics, routes=routes)


def _add_routes(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics, protected: list) -> None:
    engine = ctx.engine

    @app.get("/health", response_model=None, responses=ok(HealthResponse))
    async def health() -> Response:
        if engine.healthy:
            return JSONResponse(HealthResponse().model_dump())
        reason = "the engine has failed" if engine.dead else "the engine is not serving (starting or stopping)"
        return error_response(503, reason, code="engine_dead" if engine.dead else "not_ready",
                              headers={"Retry-After": str(ctx.config.retry_after_s)})

    @app.get("/metrics", response_model=None, dependencies=protected,
             responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}, **error_responses()})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=None, dependencies=protected, responses=ok(ModelList))
    async def models() -> Response:
        created = int(time.time())
        cards = [ModelCard(id=n, created=created, max_model_len=engine.max_model_len) for n in ctx.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}", response_model=None, dependencies=protected, responses=ok(ModelCard))
    async def model(model_id: str) -> Response:
        # OpenAI's retrieve: the SDK's client.models.retrieve(name). ":path" since served
        # names may hold a slash (org/model); the id is only compared against the list.
        ctx.check_model(model_id)
        card = ModelCard(id=model_id, created=int(time.time()), max_model_len=engine.max_model_len)
        return JSONResponse(card.model_dump())

    @app.post("/v1/completions", response_model=None, dependencies=protected,
              responses=generation_ok(CompletionResponse, CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=None, dependencies=protected,
              responses=generation_ok(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    _add_tokenizer_routes(app, ctx, protected)


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext, protected: list) -> None:
    """/tokenize, /detokenize, /tokenizer_info: what lm-eval's remote tokenizer calls."""
    engine = ctx.engine

    @app.post("/tokenize", response_model=None, dependencies=protected, responses=ok(TokenizeResponse))
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        tok = ctx.require_tokenizer()
        if body.messages is not None:
            ids = await in_thread(ctx, "messages", render_prompt, ctx, body.messages, body.add_generation_prompt)
        else:
            ids = await in_thread(ctx, "prompt",
                                  lambda: tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        out = TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)
        return JSONResponse(out.model_dump())

    @app.post("/detokenize", response_model=None, dependencies=protected, responses=ok(DetokenizeResponse))
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        tok = ctx.require_tokenizer()
        check_token_ids(ctx, body.tokens, "tokens")
        text = await in_thread(ctx, "tokens", lambda: tok.decode(body.tokens, skip_special_tokens=False))
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.get("/tokenizer_info", response_model=None, dependencies=protected, responses=ok(TokenizerInfo))
    async def tokenizer_info() -> Response:
        tok = ctx.require_tokenizer()
        info = TokenizerInfo(
            vocab_size=engine.vocab_size, model_max_length=engine.max_model_len,
            bos_token=tok.bos_token, eos_token=tok.eos_token,
            pad_token=tok.hf.id_to_token(tok.pad_token_id) if tok.pad_token_id is not None else None,
            unk_token=tok.hf.id_to_token(tok.unk_token_id) if tok.unk_token_id is not None else None,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            add_bos_token=tok.add_bos_token, chat_template=tok.chat_template)
        return JSONResponse(info.model_dump())


# ---- the process -------------------------------------------------------------------------


class _DrainingServer(uvicorn.Server):
    """uvicorn, but on SIGTERM the engine drains while the port is still open: new
    requests get 503 + Retry-After and in-flight ones finish (or end with an error)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets=None) -> None:
        cut = await self.engine.drain(self.drain_timeout_s, force=lambda: self.force_exit)
        if cut:
            log.warning("shutdown: ended %d unfinished request(s) after %.0f s", cut, self.drain_timeout_s)
            await asyncio.sleep(0.2)  # let their error events reach the clients
        await super().shutdown(sockets)


def run_server(engine_config: EngineConfig, config: ServerConfig, model_names: Sequence[str]) -> int:
    """Load the model, serve until SIGTERM/SIGINT or engine death; returns the exit code."""
    from trellm.engine.engine import Engine

    config.validate()
    engine = Engine(engine_config)  # load before binding: the port answers only once ready
    exit_code = 0
    server: _DrainingServer | None = None

    def on_dead(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        log.error("the engine died (%s: %s); shutting down", type(exc).__name__, exc)
        if server is not None:
            server.should_exit = True
        # A wedged step may never return: make sure the process still ends.
        timer = threading.Timer(config.shutdown_timeout_s + 15.0, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    async_engine = AsyncEngine(engine, max_queued_requests=config.max_queued_requests,
                               engine_step_timeout_s=config.engine_step_timeout_s,
                               max_queue_wait_s=config.max_queue_wait_s, on_dead=on_dead)
    app = build_app(async_engine, config, model_names)
    uv_config = uvicorn_config(app, host=config.host, port=config.port,
                               header_timeout_s=config.request_header_timeout_s,
                               shutdown_timeout_s=config.shutdown_timeout_s + 5.0)
    server = _DrainingServer(uv_config, async_engine, config.shutdown_timeout_s)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op SIGTERM
    # handler makes a drained shutdown end with status 0 instead of "killed by SIGTERM".
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return exit_code
