"""What the completions and chat handlers share: model lookup, request -> SamplingParams,
context checks, engine-error mapping, disconnect handling, SSE and log-prob formatting.

No engine logic lives here; the engine is reached only through ``AsyncEngine``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

import anyio.to_thread
from fastapi import Request

from trellm.config import ServerConfig
from trellm.engine.types import RequestOutput, TokenLogprobs
from trellm.sampling_params import SamplingParams
from trellm.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    NewRequest,
    QueueFullError,
    QueueTimeoutError,
    RequestStream,
    ServerStoppingError,
)
from trellm.server.errors import APIError, bad_request, sse_error, unavailable
from trellm.server.protocol import PromptTokensDetails, SamplingFields, Usage

log = logging.getLogger("trellm.server")
T = TypeVar("T")

LOGPROB_FLOOR = -9999.0
"""JSON has no -Infinity; a masked token's log-prob is reported as this (as vLLM does)."""

_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias", "max_tokens", "min_tokens",
                "stop", "stop_token_ids", "logprobs", "prompt_logprobs", "prompt")


@dataclass(frozen=True)
class ServingContext:
    """What every handler needs; built once by the app factory."""

    engine: AsyncEngine
    config: ServerConfig
    model_names: tuple[str, ...]

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            # The name is only ever compared against this allowlist, never used as a path.
            raise APIError(404, f"the model `{name[:100]}` does not exist", param="model",
                           code="model_not_found")

    def check_accepting(self) -> None:
        """Fail fast (503) before tokenizing anything when the engine cannot take work."""
        retry = self.config.retry_after_s
        if self.engine.dead:
            raise unavailable("the engine has failed; the server is restarting", retry, "engine_dead")
        if not self.engine.accepting:
            raise unavailable("the server is not accepting requests (starting or shutting down)", retry,
                              "shutting_down")

    def require_tokenizer(self):
        tok = self.engine.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer: send token ids", param="prompt")
        return tok


# ---- request -> SamplingParams --------------------------------------------------------------


def check_limits(ctx: ServingContext, req: SamplingFields, logprobs: int | None) -> None:
    """Server-configured caps (tighter than the schema's) and the vocabulary checks."""
    cfg = ctx.config
    if req.n > cfg.max_n:
        raise bad_request(f"n must be <= {cfg.max_n}", param="n")
    if logprobs is not None and logprobs > cfg.max_logprobs:
        raise bad_request(f"at most {cfg.max_logprobs} log-probs per position are allowed", param="logprobs")
    vocab = ctx.engine.vocab_size
    bad = [k for k in (req.logit_bias_ids() or {}) if k >= vocab]
    if bad:
        shown = ", ".join(str(k) for k in bad[:10])
        raise bad_request(f"logit_bias keys outside the vocabulary (size {vocab}): {shown}", param="logit_bias")
    if any(t >= vocab for t in req.stop_token_ids or ()):
        raise bad_request(f"stop_token_ids must be below the vocabulary size {vocab}", param="stop_token_ids")


def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for a validated request; its own checks still apply (ValueError -> 400)."""
    with value_errors():
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias_ids(),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(req.stop_list()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )


def output_budget(ctx: ServingContext, num_prompt_tokens: int, requested: int | None, *,
                  prompt_param: str, limit_param: str = "max_tokens") -> int:
    """max_tokens to use: as requested, or what is left of the context when omitted.

    Raises a 400 ``context_length_exceeded`` naming both numbers, never truncating."""
    limit = ctx.engine.max_model_len
    if requested is None:
        requested = limit - num_prompt_tokens
        if requested < 1:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, the input "
                f"({prompt_param}) is {num_prompt_tokens} tokens, which leaves no room for a completion.",
                param=prompt_param, code="context_length_exceeded")
        return requested
    if num_prompt_tokens + requested > limit:
        param = prompt_param if num_prompt_tokens >= limit else limit_param
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_param}, "
            f"{requested} for the completion). Please reduce the length of the {prompt_param} "
            f"or the completion.", param=param, code="context_length_exceeded")
    return requested


def check_token_ids(ctx: ServingContext, ids: Sequence[int], param: str) -> None:
    vocab = ctx.engine.vocab_size
    for t in ids:
        if t >= vocab:
            raise bad_request(f"token id {t} is outside the vocabulary (ids 0..{vocab - 1})", param=param)


async def in_thread(ctx: ServingContext, param: str, fn: Callable[..., T], *args: Any) -> T:
    """Tokenizing and template rendering cost O(input): run them off the event loop,
    within ``--tokenize-timeout`` (a 400 for ``param`` beyond it). A thread cannot be
    stopped, so one that overruns is abandoned and finishes on its own; inputs are
    bounded by the body limit, so it does finish."""
    timeout_s = ctx.config.tokenize_timeout_s
    with value_errors():
        try:
            with anyio.fail_after(timeout_s):
                return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except TimeoutError:
            raise bad_request(f"preparing the input took longer than {timeout_s:g} s; send a shorter one",
                              param=param, code="tokenization_timeout") from None


# ---- engine errors ----------------------------------------------------------------------


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


@contextlib.contextmanager
def value_errors() -> Iterator[None]:
    """ValueError from params / tokenizer / engine admission -> 400."""
    try:
        yield
    except ValueError as e:
        msg = str(e) or "invalid request"
        code = "context_length_exceeded" if "context length" in msg else None
        raise bad_request(msg, param=_param_of(msg), code=code) from None


def engine_error(ctx: ServingContext, e: BaseException, admitted: bool = True) -> APIError:
    """Map an AsyncEngine failure to the answer a client should get. A dead engine is a
    500 for requests it had accepted and a 503 for new ones (reliability.md §1.6)."""
    retry = ctx.config.retry_after_s
    if isinstance(e, QueueFullError):
        return unavailable(str(e), retry, "queue_full")
    if isinstance(e, QueueTimeoutError):
        return unavailable(str(e), retry, "queue_timeout")
    if isinstance(e, ServerStoppingError):
        return unavailable(str(e), retry, "shutting_down")
    if isinstance(e, EngineDeadError):
        if not admitted:
            return unavailable(str(e), retry, "engine_dead")
        return APIError(500, str(e), code="engine_dead", type="server_error")
    if isinstance(e, APIError):
        return e
    log.error("request failed: %s", e, exc_info=e)
    return APIError(500, "internal server error", code="internal_error", type="server_error")


async def add_all(ctx: ServingContext, jobs: Sequence[NewRequest]) -> list[RequestStream]:
    """Admit the engine requests of one HTTP request (one per prompt), all or none,
    mapping a refusal to the answer the client should get."""
    seqs = sum(j.params.n for j in jobs)
    capacity = ctx.engine.max_num_seqs + ctx.engine.max_queued_requests
    if seqs > capacity:
        # It could never be admitted, so a 503 ("retry later") would be a lie.
        raise bad_request(f"this request asks for {seqs} sequences (prompts x n); the server admits at "
                          f"most {capacity} at once", param="n" if len(jobs) == 1 else "prompt")
    try:
        with value_errors():
            return await ctx.engine.add_requests(jobs)
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as e:
        raise engine_error(ctx, e, admitted=False) from None


class ClientDisconnected(Exception):
    """The client went away before its non-streamed answer was ready."""


CLIENT_CLOSED_STATUS = 499
"""nginx's "client closed request": logged and counted, never seen by the client."""


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` but cancel it when the client disconnects (non-streaming routes),
    raising ``ClientDisconnected``: the handler's ``finally`` then aborts its engine
    requests, which frees their KV blocks."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    # Not ``task.cancelled()``: a cancelled ``asyncio.gather`` (the completions route's n
    # prompts) does not report itself cancelled on Python 3.11; it finishes holding a
    # CancelledError, which ``result()`` would raise out of the handler as a 500.
    if not finished:
        raise ClientDisconnected()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- response pieces ------------------------------------------------------------------------


def usage(outputs: Sequence[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def finite(lp: float) -> float:
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


class TokenText:
    """Token id -> the text a client sees for it in log-prob listings (cached per request)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=False) if self._tok else f"token_id:{token_id}"
            self._cache[token_id] = s
        return s

    def bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (a piece of a multi-byte character gives its own bytes,
        which a client joins to rebuild the character; its text shows U+FFFD)."""
        if self._tok is None or not hasattr(self._tok, "token_bytes"):
            return list(self(token_id).encode())
        return list(self._tok.token_bytes(token_id))


def top_dict(entry: TokenLogprobs, text: TokenText) -> dict[str, float]:
    """OpenAI's completions shape: the top-N alternatives plus the chosen token."""
    d = {text(t): finite(lp) for t, lp in entry.top}
    d.setdefault(text(entry.token_id), finite(entry.logprob))
    return d


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def stream_with_errors(ctx: ServingContext, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wrap an SSE generator: an error after the 200 header becomes an error event and
    the stream still ends with ``[DONE]``, so clients never see a silent truncation."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure must reach the client as an event
        yield sse_error(engine_error(ctx, e))
    yield SSE_DONE
