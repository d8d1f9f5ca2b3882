"""``POST /v1/completions``: prompts as text, token ids or lists of either; echo; logprobs.

One engine request per prompt; its n completions come back as choices
``prompt_index * n + completion_index`` (OpenAI's order). With ``echo`` and
``logprobs`` the prompt's own token log-probs are returned too, which is how
evaluation harnesses score log-likelihood tasks.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from trellm.engine.types import CompletionOutput, RequestOutput
from trellm.server.async_engine import NewRequest, RequestStream
from trellm.server.errors import bad_request
from trellm.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from trellm.server.serving_base import (
    CLIENT_CLOSED_STATUS,
    ClientDisconnected,
    ServingContext,
    TokenText,
    add_all,
    check_limits,
    check_token_ids,
    engine_error,
    finite,
    in_thread,
    output_budget,
    run_unless_disconnected,
    sampling_params,
    sse,
    stream_with_errors,
    top_dict,
    usage,
)


@dataclass
class _Prompt:
    text: str | None
    """As sent (None for token ids); echoed back."""
    ids: list[int]


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    ctx.check_accepting()
    check_limits(ctx, req, req.logprobs)
    prompts = await _tokenize_prompts(ctx, req)
    score_only = req.max_tokens == 0  # echo-only scoring: generate one token, show none
    base_id = ctx.engine.new_request_id("cmpl")
    jobs = []
    for i, p in enumerate(prompts):
        max_tokens = output_budget(ctx, len(p.ids), 1 if score_only else req.max_tokens, prompt_param="prompt")
        params = sampling_params(
            req, max_tokens=max_tokens, logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
        jobs.append(NewRequest(f"{base_id}-{i}", p.text, params, p.ids))
    streams = await add_all(ctx, jobs)
    view = _View(ctx, req, prompts, score_only, TokenText(ctx.engine.tokenizer))
    if req.stream:
        return StreamingResponse(stream_with_errors(ctx, _stream(ctx, req, base_id, streams, view)),
                                 media_type="text/event-stream",
                                 background=BackgroundTask(_abort_all, ctx, streams))
    try:
        outs = await run_unless_disconnected(raw, asyncio.gather(*(s.final() for s in streams)))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except Exception as e:  # engine death, shutdown: mapped to 500 / 503
        raise engine_error(ctx, e) from None
    finally:
        _abort_all(ctx, streams)
    choices = [view.choice(i, out, c) for i, out in enumerate(outs) for c in out.outputs]
    body = CompletionResponse(id=base_id, model=ctx.model_name, choices=choices, usage=view.usage(outs))
    return JSONResponse(body.model_dump())


def _abort_all(ctx: ServingContext, streams: Sequence[RequestStream]) -> None:
    for s in streams:
        ctx.engine.abort(s.request_id)  # a no-op for requests that finished


async def _tokenize_prompts(ctx: ServingContext, req: CompletionRequest) -> list[_Prompt]:
    p = req.prompt
    if isinstance(p, str):
        texts: list[str] | None = [p]
    elif p and isinstance(p[0], str):
        texts = list(p)  # type: ignore[arg-type]
    else:
        texts = None
    if texts is None:
        id_lists = [p] if p and isinstance(p[0], int) else list(p)  # type: ignore[list-item]
        for ids in id_lists:
            check_token_ids(ctx, ids, "prompt")
        return [_Prompt(None, list(ids)) for ids in id_lists]  # type: ignore[arg-type]
    tok = ctx.require_tokenizer()
    id_lists = await in_thread(ctx, "prompt", lambda: [tok.encode(t) for t in texts])
    for ids in id_lists:
        if not ids:
            raise bad_request("the prompt is empty after tokenization", param="prompt")
    return [_Prompt(t, ids) for t, ids in zip(texts, id_lists)]


@dataclass
class _View:
    """Turns engine outputs into OpenAI completion choices (whole or as stream deltas)."""

    ctx: ServingContext
    req: CompletionRequest
    prompts: list[_Prompt]
    score_only: bool
    text_of: TokenText
    _echo_text: dict[int, str] = field(default_factory=dict)
    _offsets: dict[int, int] = field(default_factory=dict)
    """Per choice: text offset after the last token listed (streams list tokens in pieces)."""

    def echo_text(self, i: int) -> str:
        if i not in self._echo_text:
            p = self.prompts[i]
            tok = self.ctx.engine.tokenizer
            # Token ids echo as decoded with their special tokens, as the listed tokens
            # (and their text_offsets) show them; vLLM does the same.
            self._echo_text[i] = p.text if p.text is not None else (
                tok.decode(p.ids, skip_special_tokens=False) if tok else "")
        return self._echo_text[i]

    def index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.req.n + c.index

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        text = "" if self.score_only else c.text
        if self.req.echo:
            text = self.echo_text(i) + text
        return CompletionChoice(index=self.index(i, c), text=text, logprobs=self.logprobs(i, out, c, 0),
                                finish_reason=_finish(c.finish_reason, self.score_only))

    def logprobs(self, i: int, out: RequestOutput, c: CompletionOutput, start: int) -> CompletionLogprobs | None:
        """Log-probs of generated tokens from ``start`` (preceded by the prompt's when
        echoing and ``start`` is 0). ``text_offset`` counts characters from the start of
        the prompt, as OpenAI's legacy API does."""
        if self.req.logprobs is None:
            return None
        lp = CompletionLogprobs()
        key = self.index(i, c)
        offset = self._offsets.get(key, 0 if self.req.echo else len(self.echo_text(i)))
        if start == 0 and self.req.echo:
            entries = out.prompt_logprobs or []
            for k, tid in enumerate(out.prompt_token_ids):
                e = entries[k] if k < len(entries) else None
                offset = self._add(lp, tid, e.logprob if e else None, top_dict(e, self.text_of) if e else None,
                                   offset)
        if not self.score_only:
            for tid, e in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
                offset = self._add(lp, tid, e.logprob, top_dict(e, self.text_of), offset)
        self._offsets[key] = offset
        return lp

    def _add(self, lp: CompletionLogprobs, tid: int, logprob: float | None, top: dict | None,
             offset: int) -> int:
        s = self.text_of(tid)
        lp.tokens.append(s)
        lp.token_logprobs.append(None if logprob is None else finite(logprob))
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        return offset + len(s)

    def usage(self, outs: Sequence[RequestOutput]):
        u = usage(outs)
        if self.score_only:
            u.completion_tokens = 0
            u.total_tokens = u.prompt_tokens
        return u


def _finish(reason: str | None, score_only: bool) -> str | None:
    if score_only and reason is not None:
        return "length"
    return reason if reason in ("stop", "length") else None


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    nexts: dict[asyncio.Future, int] = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = nexts.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not out.finished:
                    nexts[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for fut in nexts:
            fut.cancel()


async def _stream(ctx: ServingContext, req: CompletionRequest, rid: str, streams: Sequence[RequestStream],
                  view: _View) -> AsyncIterator[str]:
    created = int(time.time())
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    ended: set[int] = set()  # a choice's finish_reason goes out once
    try:
        async for i, out in _merge(streams):
            choices = []
            for c in out.outputs:
                if not c.token_ids and c.finish_reason is None:
                    continue  # prompt still computing (possibly with partial prompt log-probs)
                idx = view.index(i, c)
                if idx in ended:
                    continue
                first = idx not in sent_text
                text = "" if view.score_only else c.text[sent_text.get(idx, 0):]
                new_tokens = len(c.token_ids) - sent_tokens.get(idx, 0)
                finish = _finish(c.finish_reason, view.score_only)
                if not (first or text or new_tokens > 0 or finish):
                    continue
                if finish:
                    ended.add(idx)
                if first and req.echo:
                    text = view.echo_text(i) + text
                logprobs = view.logprobs(i, out, c, sent_tokens.get(idx, 0))
                sent_text[idx] = len(c.text)
                sent_tokens[idx] = len(c.token_ids)
                choices.append(CompletionChoice(index=idx, text=text, logprobs=logprobs, finish_reason=finish))
            if out.finished:
                finals[i] = out
            if choices:
                chunk = CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=choices)
                yield sse(chunk.model_dump_json())
    finally:
        _abort_all(ctx, streams)
    if req.stream_options and req.stream_options.include_usage:
        chunk = CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[],
                                   usage=view.usage([finals[i] for i in sorted(finals)]))
        yield sse(chunk.model_dump_json())
