"""``POST /v1/chat/completions``: the model's chat template, then the engine.

Messages are rendered with the model's own (sandboxed) template, off the event
loop, and tokenized without adding special tokens again (the template has them).
Special-token text inside message content is tokenized as plain text
(``Tokenizer.encode_chat``), so a message cannot forge a turn.
"""
from __future__ import annotations

import json
import time
from typing import AsyncIterator, Sequence

from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from trellm.engine.types import CompletionOutput, TokenLogprobs
from trellm.server.async_engine import NewRequest, RequestStream
from trellm.server.errors import bad_request
from trellm.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChoiceLogprobs,
    DeltaMessage,
    TemplateKwargs,
    TokenLogprob,
    TopLogprob,
)
from trellm.server.serving_base import (
    CLIENT_CLOSED_STATUS,
    ClientDisconnected,
    ServingContext,
    TokenText,
    add_all,
    check_limits,
    engine_error,
    finite,
    in_thread,
    output_budget,
    run_unless_disconnected,
    sampling_params,
    sse,
    stream_with_errors,
    usage,
)


def render_prompt(ctx: ServingContext, req_messages, add_generation_prompt: bool,
                  template_kwargs: TemplateKwargs | None = None) -> list[int]:
    """Template + tokenize (blocking: call through ``in_thread``)."""
    tok = ctx.engine.tokenizer
    if tok is None or not tok.chat_template:
        raise ValueError("this model has no chat template; use /v1/completions")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req_messages]
    extra = template_kwargs.model_dump(exclude_none=True) if template_kwargs else {}
    return tok.encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    ctx.check_accepting()
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    check_limits(ctx, req, top_n)
    ids = await in_thread(ctx, "messages", render_prompt, ctx, req.messages, req.add_generation_prompt,
                          req.chat_template_kwargs)
    if not ids:
        raise bad_request("the conversation renders to an empty prompt", param="messages")
    limit = req.output_limit()
    # Name the field the client sent: the newer max_completion_tokens wins over max_tokens.
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = output_budget(ctx, len(ids), limit, prompt_param="messages", limit_param=limit_param)
    params = sampling_params(req, max_tokens=max_tokens, logprobs=top_n)
    rid = ctx.engine.new_request_id("chatcmpl")
    (stream,) = await add_all(ctx, [NewRequest(rid, None, params, ids)])
    text_of = TokenText(ctx.engine.tokenizer)
    if req.stream:
        return StreamingResponse(stream_with_errors(ctx, _stream(ctx, req, rid, stream, text_of)),
                                 media_type="text/event-stream",
                                 background=BackgroundTask(ctx.engine.abort, rid))
    try:
        out = await run_unless_disconnected(raw, stream.final())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except Exception as e:  # engine death, shutdown: mapped to 500 / 503
        raise engine_error(ctx, e) from None
    finally:
        ctx.engine.abort(rid)
    choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text),
                          logprobs=_logprobs(c.token_ids, c.logprobs, 0, text_of) if req.logprobs else None,
                          finish_reason=_finish(c)) for c in out.outputs]
    body = ChatCompletionResponse(id=rid, model=ctx.model_name, choices=choices, usage=usage([out]))
    return JSONResponse(body.model_dump())


def _finish(c: CompletionOutput) -> str | None:
    return c.finish_reason if c.finish_reason in ("stop", "length") else None


def _logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs] | None, start: int,
              text_of: TokenText) -> ChoiceLogprobs:
    content = []
    for tid, e in zip(token_ids[start:], (entries or [])[start:]):
        s = text_of(tid)
        top = [TopLogprob(token=text_of(t), logprob=finite(lp), bytes=text_of.bytes(t)) for t, lp in e.top]
        content.append(TokenLogprob(token=s, logprob=finite(e.logprob), bytes=text_of.bytes(tid), top_logprobs=top))
    return ChoiceLogprobs(content=content)


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, rid: str, stream: RequestStream,
                  text_of: TokenText) -> AsyncIterator[str]:
    created = int(time.time())

    with_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[ChatChunkChoice], usage_=None) -> str:
        c = ChatCompletionChunk(id=rid, created=created, model=ctx.model_name, choices=choices, usage=usage_)
        # Deltas carry only what changed, but a choice always has "logprobs" and
        # "finish_reason" (null until set) and, with include_usage, every chunk has
        # "usage" (null until the last): OpenAI's shape, which raw-JSON clients index.
        body = c.model_dump(exclude_none=True)
        for ch in body["choices"]:
            ch.setdefault("logprobs", None)
            ch.setdefault("finish_reason", None)
        if with_usage:
            body.setdefault("usage", None)
        return sse(json.dumps(body, ensure_ascii=False, separators=(",", ":")))

    # OpenAI opens each choice with the role and an empty content.
    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(req.n)])
    sent_text = [0] * req.n
    sent_tokens = [0] * req.n
    ended = [False] * req.n  # a choice's finish_reason goes out once
    final = None
    try:
        async for out in stream:
            choices = []
            for c in out.outputs:
                delta = c.text[sent_text[c.index]:]
                new_tokens = len(c.token_ids) > sent_tokens[c.index]
                if ended[c.index] or not (delta or new_tokens or c.finished):
                    continue
                ended[c.index] = c.finished
                lps = _logprobs(c.token_ids, c.logprobs, sent_tokens[c.index], text_of) if req.logprobs else None
                sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                choices.append(ChatChunkChoice(index=c.index, delta=DeltaMessage(content=delta or None),
                                               logprobs=lps, finish_reason=_finish(c)))
            if choices:
                yield chunk(choices)
            if out.finished:
                final = out
    finally:
        ctx.engine.abort(rid)
    if final is not None and with_usage:
        yield chunk([], usage([final]))
